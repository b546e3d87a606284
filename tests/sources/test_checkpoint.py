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
        assert sources["w"].expected_fingerprint is not None  # checked again when written
