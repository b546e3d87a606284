"""Checkpoints of a model's state dict in each kind write_ptd reads (tests' helper)."""

from __future__ import annotations

import json
import os

import torch


def state_of(model):
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def save_checkpoint(kind, state, folder):
    """Write ``state`` as checkpoint ``kind``; return the path to hand write_ptd."""
    import safetensors.torch as st

    folder.mkdir(parents=True, exist_ok=True)
    if kind == "torch":
        path = folder / "ckpt.pt"
        torch.save(state, path)
    elif kind == "safetensors":
        path = folder / "model.safetensors"
        st.save_file(untied(state), path)
    elif kind == "hf-sharded":
        keys = list(untied(state))
        shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
        weight_map = {}
        for name, part in shards.items():
            st.save_file({k: state[k] for k in part}, folder / name)
            weight_map.update({k: name for k in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        path = folder  # the folder: found through its index
    elif kind == "dcp":
        import torch.distributed.checkpoint as dcp

        path = folder / "dcp"
        dcp.save(untied(state), checkpoint_id=str(path), no_dist=True)
    return str(path)


def untied(state):
    """safetensors and DCP refuse (or duplicate) shared tensors: keep the first key of each."""
    seen, out = set(), {}
    for k, v in state.items():
        if v.untyped_storage().data_ptr() not in seen:
            seen.add(v.untyped_storage().data_ptr())
            out[k] = v
    return out


def rewrite_in_place(path, state, kind) -> None:
    """Write ``state`` over the checkpoint at ``path`` in place: same inode, same size."""
    import safetensors.torch as st

    if kind == "safetensors":
        data = st.save(state)
    else:  # the archive's name is the file's: save beside it under the same name
        other = os.path.join(os.path.dirname(path), "new")
        os.makedirs(other, exist_ok=True)
        torch.save(state, os.path.join(other, os.path.basename(path)))
        with open(os.path.join(other, os.path.basename(path)), "rb") as f:
            data = f.read()
    assert len(data) == os.path.getsize(path)
    inode = os.stat(path).st_ino
    with open(path, "r+b") as f:
        f.write(data)
    assert os.stat(path).st_ino == inode


def safetensors_offset(path, key) -> int:
    """The file offset of ``key``'s data in the safetensors file ``path``, read from its header."""
    with open(path, "rb") as f:
        header_nbytes = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_nbytes))
    return 8 + header_nbytes + header[key]["data_offsets"][0]
