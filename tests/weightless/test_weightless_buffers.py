"""A KV cache as an exportable decoder registers it (large buffers, updated in
place by each step) is moved to files of the context's folder before
torch.export, in place: the saved program is the real export's bytes, the cache
object and the module keep the same tensors, and a storage shared with a view
held elsewhere is left in memory."""

from __future__ import annotations

import warnings

import pytest
import torch
from _checkpoints import save_checkpoint, state_of
from conftest import read_folder

import ptdstream
from ptdstream.system.pagecache import file_mapping
from ptdstream.weightless import weights_from
from ptdstream.weightless.buffers import MOVE_NBYTES

warnings.filterwarnings("ignore")

SEQ, DIM = 1024, 512  # a 2 MiB float32 cache per key and value: above MOVE_NBYTES


class Cache:
    """The cache object a decoder wrapper keeps beside its module (transformers' StaticCache)."""

    def __init__(self) -> None:
        self.keys = torch.zeros(SEQ, DIM)
        self.values = torch.zeros(SEQ, DIM)


class Decoder(torch.nn.Module):
    """A linear whose outputs are written into the cache at ``pos``; a large constant mask (not mutated)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(DIM, DIM, bias=False)
        self.cache = Cache()
        self.register_buffer("key_cache", self.cache.keys, persistent=False)
        self.register_buffer("value_cache", self.cache.values, persistent=False)
        self.register_buffer("mask", torch.arange(SEQ * DIM, dtype=torch.float32).view(SEQ, DIM) / 1e6,
                             persistent=False)

    def forward(self, x, pos):
        k = self.proj(x)
        self.key_cache.index_copy_(0, pos, k)
        self.value_cache.index_copy_(0, pos, k * 2)
        return (self.key_cache * self.mask).sum(0, keepdim=True) + self.value_cache[:1]


def _inputs():
    return (torch.randn(1, DIM), torch.tensor([3]))


def _save(model, folder):
    from executorch.exir import ExecutorchBackendConfig, to_edge

    with torch.no_grad():  # as exporters trace a decoder
        program = torch.export.export(model, _inputs())
    manager = to_edge(program).to_executorch(
        ExecutorchBackendConfig(external_constants=True))
    folder.mkdir()
    ptdstream.save(manager, str(folder / "model.pte"))
    return read_folder(str(folder))


def _seeded():
    torch.manual_seed(0)
    return Decoder().eval()


def test_a_kv_cache_moved_to_files_saves_the_real_exports_bytes(tmp_path):
    assert SEQ * DIM * 4 >= MOVE_NBYTES
    want = _save(_seeded(), tmp_path / "real")
    real = _seeded()
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        model = weights.model(Decoder)
        keys = model.key_cache
        got = _save(model, tmp_path / "weightless")
        assert model.key_cache is keys and model.cache.keys is keys  # the same tensor objects, re-pointed
        assert model.cache.values is model.value_cache
        for name in ("key_cache", "value_cache", "mask"):
            tensor = getattr(model, name)
            assert file_mapping(tensor.data_ptr(), tensor.untyped_storage().nbytes()) is not None, name
        assert torch.equal(model.mask, real.mask) and not model.key_cache.any()
    assert got == want


def test_a_buffer_whose_storage_a_view_elsewhere_shares_is_left_in_memory(tmp_path):
    real = _seeded()
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        model = weights.model(Decoder)
        elsewhere = model.key_cache[:8]  # a view the module does not know of
        _save(model, tmp_path / "weightless")
        assert elsewhere.untyped_storage().data_ptr() == model.key_cache.untyped_storage().data_ptr()
        assert file_mapping(model.key_cache.data_ptr(), SEQ * DIM * 4) is None
        assert file_mapping(model.value_cache.data_ptr(), SEQ * DIM * 4) is not None


@pytest.mark.parametrize("step", [0, 1])
def test_a_moved_cache_is_written_by_an_eager_step_after_the_block(tmp_path, step):
    """The file mapping is shared and writable: the module runs eagerly after the
    export, inside the block or after it, as it would in memory."""
    real = _seeded()
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        model = weights.model(Decoder)
        _save(model, tmp_path / "weightless")
        if step == 0:
            model.key_cache.fill_(1.5)
    if step == 1:
        model.key_cache.fill_(1.5)
    assert torch.equal(model.cache.keys, torch.full((SEQ, DIM), 1.5))
