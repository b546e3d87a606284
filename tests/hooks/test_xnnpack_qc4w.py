"""XNNPACK's 4-bit packing of a large weight in bands into a file: upstream's bytes
(``NodeVisitor.convert_to_qc4w``), its own error for a value out of range, and the
pages of a weight mapped from a file handed back band by band."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import mapping_rss
from executorch.backends.xnnpack.operators.node_visitor import NodeVisitor

from ptdstream.hooks import xnnpack_qc4w
from ptdstream.hooks.xnnpack import xnnpack_constants_by_reference
from ptdstream.hooks.xnnpack_qc4w import pack_qc4w_in_bands, packing_qc4w_in_bands
from ptdstream.system.pagecache import file_mapping
from ptdstream.weightless.mapped_copy import RowFiles, mapped_copy

UPSTREAM = NodeVisitor.convert_to_qc4w  # the function itself, read before any context shadows it


def _int4(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8)


@pytest.mark.parametrize("rows, cols, band_nbytes", [(7, 64, 3 * 64), (64, 32, 32), (5, 8, 1 << 20), (33, 130, 260)])
def test_bands_give_upstreams_bytes(tmp_path, rows, cols, band_nbytes):
    weight = _int4(rows, cols, rows)
    with RowFiles(str(tmp_path)) as sink:
        packed = pack_qc4w_in_bands(weight, sink, band_nbytes)
    want = UPSTREAM(weight.clone())
    assert (packed.dtype, tuple(packed.shape)) == (torch.uint8, (rows, cols // 2))
    assert torch.equal(packed, want)
    assert file_mapping(packed.data_ptr(), packed.numel()) is not None  # in a file, not in memory
    assert os.listdir(tmp_path) == []  # nameless


@pytest.mark.parametrize("bad", [8, -9, 127, -128])
def test_a_value_out_of_range_gives_none_and_upstreams_own_error_through_the_patch(tmp_path, monkeypatch, bad):
    weight = _int4(40, 16)
    weight[37, 5] = bad  # in the last band
    with RowFiles(str(tmp_path)) as sink:
        assert pack_qc4w_in_bands(weight, sink, 16 * 4) is None
    monkeypatch.setattr(xnnpack_qc4w, "BANDED_MIN_NBYTES", 1)
    monkeypatch.setattr(xnnpack_qc4w, "BAND_NBYTES", 64)
    with pytest.raises(AssertionError) as upstream:
        UPSTREAM(weight)
    with xnnpack_constants_by_reference(), packing_qc4w_in_bands(lambda: RowFiles(str(tmp_path))):
        with pytest.raises(AssertionError) as patched:
            NodeVisitor.convert_to_qc4w(weight)
    assert str(patched.value) == str(upstream.value) == \
        f"convert_to_qc4w: [min,max] out of [-8, 7] range, got [{min(-8, bad)}, {max(7, bad)}]"


def test_only_the_thread_inside_the_context_and_only_large_even_2d_int8_weights_are_banded(tmp_path, monkeypatch):
    calls = []
    real = xnnpack_qc4w.pack_qc4w_in_bands
    monkeypatch.setattr(xnnpack_qc4w, "pack_qc4w_in_bands", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(xnnpack_qc4w, "BANDED_MIN_NBYTES", 256)
    big, small, odd = _int4(16, 16), _int4(15, 16), _int4(16, 17)
    assert NodeVisitor.convert_to_qc4w is UPSTREAM
    with xnnpack_constants_by_reference(), packing_qc4w_in_bands(lambda: RowFiles(str(tmp_path))):
        for weight in (big, small, odd, big.to(torch.int32)):
            assert torch.equal(NodeVisitor.convert_to_qc4w(weight), UPSTREAM(weight))
    assert calls == [1]  # big only: small is under the size, odd has an odd column count, int32 is not int8
    assert NodeVisitor.convert_to_qc4w is UPSTREAM  # restored


def test_a_weight_mapped_from_a_file_is_read_band_by_band_its_pages_handed_back(tmp_path):
    weight = mapped_copy(_int4(4096, 4096), str(tmp_path))  # 16 MiB in a file
    resident = []

    class Sink(RowFiles):
        def append(self, name, band):
            super().append(name, band)
            resident.append(mapping_rss(weight.data_ptr()))

    with Sink(str(tmp_path)) as sink:
        packed = pack_qc4w_in_bands(weight, sink, 1 << 20)
    assert len(resident) == 16
    # one band of 1 MiB mapped in at a time, and what the kernel maps around a fault (up to 2 MiB), not 16 MiB
    assert max(resident) <= 3 << 20, resident
    assert torch.equal(packed, UPSTREAM(weight.clone()))


