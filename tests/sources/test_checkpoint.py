"""Checkpoint sources: every kind lists its tensors with dtype, shape and dim order,
and streams exactly their bytes."""

from __future__ import annotations

import json

import pytest
import torch

from ptdstream.errors import FormatError
from ptdstream.sources import BufferRing
from ptdstream.sources.checkpoint import DcpTensorSource, open_checkpoint


def _bytes(source) -> bytes:
    return b"".join(bytes(p) for p in source.pieces(BufferRing(64, count=2)))


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()


STATE = {
    "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "h": torch.arange(300, dtype=torch.bfloat16),
    "i": torch.tensor([1, 2, 3], dtype=torch.int64),
}


def test_torch_save_entries_aliases_and_channels_last(tmp_path):
    conv = torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)
    state = dict(STATE, tied=STATE["w"], conv=conv)
    torch.save(state, tmp_path / "c.pt")
    with open_checkpoint(str(tmp_path / "c.pt")) as ckpt:
        assert ckpt.kind == "torch"
        assert list(ckpt.entries) == ["w", "h", "i", "tied", "conv"]
        assert ckpt.aliases == {"w": "w", "tied": "w"}
        h = ckpt.entries["h"]
        assert (h.dtype, h.shape, h.dim_order, h.nbytes) == (torch.bfloat16, (300,), (0,), 600)
        assert ckpt.entries["conv"].dim_order == (0, 2, 3, 1)
        for key, t in state.items():
            data = _bytes(ckpt.source(key))
            if key == "conv":  # memory order: channels last
                assert data == _raw(t.permute(0, 2, 3, 1))
            else:
                assert data == _raw(t)


def test_safetensors_and_hf_index(tmp_path):
    import safetensors.torch as st

    st.save_file({"w": STATE["w"], "h": STATE["h"]}, tmp_path / "a.safetensors")
    st.save_file({"i": STATE["i"], "stray": torch.zeros(1)}, tmp_path / "b.safetensors")
    index = {"weight_map": {"w": "a.safetensors", "h": "a.safetensors", "i": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with open_checkpoint(str(tmp_path)) as ckpt:
        assert ckpt.kind == "safetensors"
        assert sorted(ckpt.entries) == ["h", "i", "w"]  # 'stray' is in no index entry
        for key in ckpt.entries:
            assert _bytes(ckpt.source(key)) == _raw(STATE[key])
        assert type(ckpt.source("w")).__name__ == "MappedTensorSource"
    index["weight_map"]["gone"] = "b.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match=r"1 key\(s\) named by the index are not in their shard: 'gone' "
                                          r"\(b.safetensors\)"):
        open_checkpoint(str(tmp_path))


def test_dcp_one_tensor_at_a_time(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = dict(STATE, same=STATE["w"].clone(), other=STATE["w"] + 1, note=b"not a tensor")
    dcp.save(state, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    with open_checkpoint(str(tmp_path / "d")) as ckpt:
        assert ckpt.kind == "dcp" and ckpt.skipped == ["note"]
        assert sorted(ckpt.entries) == ["h", "i", "other", "same", "w"]
        sources = {k: ckpt.source(k) for k in ckpt.entries}
        assert all(isinstance(s, DcpTensorSource) for s in sources.values())
        for key, source in sources.items():
            assert _bytes(source) == _raw(state[key])
        assert sources["w"].prefix(8) == _raw(STATE["w"])[:8]
        assert sources["w"].same_content(sources["same"]) is True
        assert sources["w"].same_content(sources["other"]) is False
        assert sources["w"].same_content(sources["i"]) is None  # other sizes: the store never asks
        assert sources["w"].expectation.fingerprint is not None  # checked again when written


def test_mapped_checkpoints_are_read_from_the_file_while_it_is_the_mapped_one(tmp_path, monkeypatch):
    """Pieces come from pread of the tensor's file range; after the file is replaced
    (os.replace), from the mapping, which still holds the handed-over bytes."""
    import os

    import safetensors.torch as st

    from ptdstream.sources import file as file_module

    reads = []
    real_pread = file_module.pread_exact
    monkeypatch.setattr(file_module, "pread_exact",
                        lambda fd, view, offset: reads.append((offset, len(view))) or real_pread(fd, view, offset))
    path = tmp_path / "a.safetensors"
    st.save_file({"w": STATE["w"], "h": STATE["h"]}, path)
    with open_checkpoint(str(path)) as ckpt:
        assert _bytes(ckpt.source("h")) == _raw(STATE["h"])
        raw = path.read_bytes()
        header_nbytes = int.from_bytes(raw[:8], "little")
        data_start = 8 + header_nbytes + json.loads(raw[8 : 8 + header_nbytes])["h"]["data_offsets"][0]
        assert reads[0] == (data_start, 64) and sum(n for _, n in reads) == 600
        reads.clear()
        st.save_file({"w": torch.zeros(3, 4), "h": torch.zeros(300, dtype=torch.bfloat16)}, tmp_path / "b")
        os.replace(tmp_path / "b", path)
        assert _bytes(ckpt.source("h")) == _raw(STATE["h"])
        assert _bytes(ckpt.source("w")) == _raw(STATE["w"])
        assert reads == []


def test_torch_save_of_native_byte_order_is_read_from_the_file(tmp_path, monkeypatch):
    from ptdstream.sources import file as file_module
    from ptdstream.sources.checkpoint import _archive_byteorder

    reads = []
    real_pread = file_module.pread_exact
    monkeypatch.setattr(file_module, "pread_exact",
                        lambda fd, view, offset: reads.append(len(view)) or real_pread(fd, view, offset))
    torch.save(STATE, tmp_path / "c.pt")
    assert _archive_byteorder(str(tmp_path / "c.pt")) == "little"
    assert _archive_byteorder(str(tmp_path / "missing.pt")) == "unknown"
    with open_checkpoint(str(tmp_path / "c.pt")) as ckpt:
        for key, t in STATE.items():
            assert _bytes(ckpt.source(key)) == _raw(t)
    assert sum(reads) == sum(t.numel() * t.element_size() for t in STATE.values())
