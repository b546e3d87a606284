"""CUDA tensor sources give the same bytes as the same data on the CPU (skipped without a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from ptdstream import BufferRing, StreamingNamedDataStore, as_source
from ptdstream.save import write_data_files

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES = [
    (torch.uint8, (1,)),
    (torch.float32, (3, 5)),
    (torch.bfloat16, (1001,)),
    (torch.float16, (7, 9, 3)),
    (torch.int64, (0,)),
    (torch.float32, (3 << 20,)),  # 12 MiB: several pieces
]


@pytest.mark.parametrize("dtype,shape", CASES, ids=[f"{d}-{s}" for d, s in CASES])
def test_cuda_source_bytes_equal_cpu_bytes(dtype, shape):
    torch.manual_seed(0)
    cpu = (torch.randn(shape) * 100).to(dtype)
    gpu = cpu.cuda()
    ring = BufferRing(1 << 20, 2)
    got = b"".join(bytes(p) for p in as_source(gpu).pieces(ring))
    want = b"".join(bytes(p) for p in as_source(cpu).pieces(ring))
    assert got == want and len(got) == cpu.numel() * cpu.element_size()


def test_fp8_and_storage_offset():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no fp8 dtype")
    base = torch.randn(64, 33).cuda()
    view = base[5:9]  # contiguous, non-zero storage offset
    ring = BufferRing(100, 2)
    assert b"".join(bytes(p) for p in as_source(view).pieces(ring)) == view.cpu().numpy().tobytes()
    fp8 = torch.randn(1000).to(torch.float8_e4m3fn).cuda()
    got = b"".join(bytes(p) for p in as_source(fp8).pieces(ring))
    assert got == fp8.cpu().view(torch.uint8).numpy().tobytes()


def test_ptd_from_cuda_equals_ptd_from_cpu(tmp_path):
    torch.manual_seed(0)
    weights = {f"layers.{i}.weight": torch.randn(257, 129).to(torch.bfloat16) for i in range(4)}
    weights["tied"] = weights["layers.0.weight"]
    outs = []
    for device in ("cpu", "cuda"):
        store = StreamingNamedDataStore()
        for key, t in weights.items():
            store.add_named_data(key, t.to(device), alignment=16, external_tag="aoti_cuda_blob")
        folder = tmp_path / device
        folder.mkdir()
        write_data_files(store, str(folder))
        outs.append((folder / "aoti_cuda_blob.ptd").read_bytes())
        assert os.listdir(folder) == ["aoti_cuda_blob.ptd"]
    assert outs[0] == outs[1]


def test_gpu_fingerprint_separates_and_matches():
    from ptdstream.sources.cuda_fingerprint import ROW_NBYTES, gpu_fingerprint

    torch.manual_seed(0)
    for n in (0, 1, 31, ROW_NBYTES, ROW_NBYTES * 17 + 5, (3 << 20) + 7):
        a = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        assert gpu_fingerprint(a) == gpu_fingerprint(a.clone())
        if n:
            b = a.clone()
            b[n // 2] ^= 1
            assert gpu_fingerprint(a) != gpu_fingerprint(b)
            c = a.clone()
            c[-1] ^= 0x80  # the top bit of the last byte
            assert gpu_fingerprint(a) != gpu_fingerprint(c)
    # Two flipped top bits that cancel in a plain sum mod 2^64 still differ.
    x = torch.zeros(8 * 1024, dtype=torch.uint8, device="cuda")
    y = x.clone()
    y.view(torch.int64)[3] = -(1 << 63)
    y.view(torch.int64)[9] = -(1 << 63)
    assert gpu_fingerprint(x) != gpu_fingerprint(y)


def test_collector_pattern_dedups_on_the_device_without_host_copies(tmp_path, monkeypatch):
    from ptdstream.sources import cuda as cuda_mod

    torch.manual_seed(0)
    weights = {f"layers.{i}.weight": torch.randn(512, 256, device="cuda").to(torch.bfloat16) for i in range(3)}
    store = StreamingNamedDataStore()
    copies = []
    original = cuda_mod.CudaTensorSource.pieces

    def counting(self, ring):
        for piece in original(self, ring):
            copies.append(len(piece))
            yield piece

    monkeypatch.setattr(cuda_mod.CudaTensorSource, "pieces", counting)
    for method in ("forward", "prefill", "decode"):
        for key, t in weights.items():
            # Later methods pass other tensor objects over the same storage, and
            # an equal copy in another storage under a new key.
            store.add_named_data(key, t.view(t.shape), external_tag="aoti_cuda_blob")
        store.add_named_data(f"{method}.copy", weights["layers.0.weight"].clone(), external_tag="aoti_cuda_blob")
    assert len(store.buffers) == 3 and copies == [], "dedup happened on the device"
    assert store.dedup_saved_nbytes == 3 * 512 * 256 * 2
    other = torch.randn(512, 256, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^Duplicate key layers.1.weight with different data\."):
        store.add_named_data("layers.1.weight", other, external_tag="aoti_cuda_blob")
    write_data_files(store, str(tmp_path))
    assert sum(copies) == 3 * 512 * 256 * 2, "each storage copied to the host once, at the write"


def test_freed_cuda_storage_is_an_error_naming_the_key(tmp_path):
    from ptdstream.errors import IntegrityError

    t = torch.randn(256, 256, device="cuda")
    store = StreamingNamedDataStore()
    store.add_named_data("decoder.weight", t, external_tag="aoti_cuda_blob")
    t.untyped_storage().resize_(0)
    with pytest.raises(IntegrityError, match=r"key 'decoder.weight'.*freed or resized"):
        write_data_files(store, str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_gibibytes_from_cuda_equal_the_same_data_from_the_cpu(tmp_path):
    """2 GiB + 3 bytes of random bf16/uint8 data: the CUDA path's .ptd equals the CPU path's."""
    import xxhash

    torch.manual_seed(0)
    big = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    odd = torch.randint(0, 256, (3,), dtype=torch.uint8, device="cuda")
    digests = []
    for device in ("cuda", "cpu"):
        store = StreamingNamedDataStore()
        store.add_named_data("big", big.to(device), alignment=64, external_tag="w")
        store.add_named_data("odd", odd.to(device), external_tag="w")
        folder = tmp_path / device
        folder.mkdir()
        write_data_files(store, str(folder))
        h = xxhash.xxh3_128()
        with open(folder / "w.ptd", "rb") as f:
            while chunk := f.read(64 << 20):
                h.update(chunk)
        digests.append(h.hexdigest())
        os.remove(folder / "w.ptd")
    assert digests[0] == digests[1]
