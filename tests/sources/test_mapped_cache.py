"""A mapped checkpoint's page policy: the export's hash keeps its page cache, the save drops it."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from conftest import mapping_rss, skip_unless_pages_can_drop
from safetensors.torch import load_file, save_file

from ptdstream.hooks.emitter import reference
from ptdstream.sources import mapped
from ptdstream.sources.base import BufferRing
from ptdstream.system import pagecache
from ptdstream.system.pagecache import drop_pages, file_mapping, release_mapped, resident_nbytes

MiB = 1 << 20


def _cold_checkpoint(tmp_path, nbytes: int) -> tuple[str, torch.Tensor, bytes]:
    path = str(tmp_path / "w.safetensors")
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    save_file({"w": data}, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    drop_pages(fd, 0, 0)
    os.close(fd)
    return path, load_file(path)["w"], hashlib.sha256(data.numpy().tobytes()).digest()


def test_the_hash_keeps_the_page_cache_out_of_rss_and_the_save_drops_it(tmp_path, monkeypatch):
    skip_unless_pages_can_drop(tmp_path)
    nbytes = 48 * MiB
    path, tensor, digest = _cold_checkpoint(tmp_path, nbytes)
    paged_out: list[int] = []
    real_page_out = mapped.page_out
    monkeypatch.setattr(mapped, "page_out", lambda a, n, b: (paged_out.append(n), real_page_out(a, n, b)))
    ref = reference(tensor.untyped_storage(), "w")
    assert ref.file_mapped and isinstance(ref.source, mapped.MappedTensorSource)

    assert ref.sha256() == digest
    # the export's hash: nothing paged out or dropped, the file's pages left in the
    # page cache, and nothing of the mapping in this process's RSS (read with pread)
    assert paged_out == []
    assert resident_nbytes(path) >= nbytes - 8 * MiB, resident_nbytes(path)
    assert mapping_rss(tensor.data_ptr()) <= 4 * MiB, mapping_rss(tensor.data_ptr())

    # the save reads the same source: the same bytes, the file's pages dropped
    # (before: read through the mapping, MADV_PAGEOUT left 40 of these 48 MiB cached)
    ring = BufferRing(8 * MiB, count=3)
    saved = hashlib.sha256()
    for piece in ref.source.pieces(ring):
        saved.update(piece)
    assert saved.digest() == digest
    assert resident_nbytes(path) <= 4 * MiB, resident_nbytes(path)
    assert mapping_rss(tensor.data_ptr()) <= 4 * MiB


def test_release_keeps_a_page_written_in_a_private_mapping(tmp_path, monkeypatch):
    nbytes = 4 * MiB
    path, tensor, _ = _cold_checkpoint(tmp_path, nbytes)
    address = tensor.data_ptr()
    mapping = file_mapping(address, nbytes)
    assert mapping is not None
    bounds = (mapping.start, mapping.stop)
    first = int(tensor[0])
    tensor[: 2 * MiB].sum()  # file pages mapped in, none written
    assert release_mapped(address, 2 * MiB, bounds) is True
    assert int(tensor[0]) == first  # the file's page, mapped in again

    paged_out: list[int] = []
    monkeypatch.setattr(pagecache, "page_out", lambda a, n, b: paged_out.append(n))
    tensor[MiB] = (int(tensor[MiB]) + 1) % 256  # a private copy of one page
    written = int(tensor[MiB])
    # MADV_DONTNEED would discard the copy (the file's byte back): paged out instead
    assert release_mapped(address, 2 * MiB, bounds) is False
    assert paged_out == [2 * MiB]
    assert int(tensor[MiB]) == written
    # a range without the written page is still released with its cache kept
    assert release_mapped(address + 2 * MiB, 2 * MiB, bounds) is True
    assert paged_out == [2 * MiB]


@pytest.mark.parametrize("nbytes", [0, -1])
def test_release_of_nothing_is_a_no_op(nbytes):
    assert release_mapped(4096, nbytes, (0, 1 << 30)) is False


def test_a_tensor_written_in_its_private_mapping_is_read_from_memory_not_the_file(tmp_path):
    nbytes = 12 * MiB
    path, tensor, digest = _cold_checkpoint(tmp_path, nbytes)
    tensor[9 * MiB] = (int(tensor[9 * MiB]) + 1) % 256  # a private copy of one page: memory != file
    expected = hashlib.sha256(tensor.numpy().tobytes()).digest()
    assert expected != digest
    ref = reference(tensor.untyped_storage(), "w")
    # pread would read the file's byte: the written page makes both reads go through the mapping
    assert ref.sha256() == expected
    saved = hashlib.sha256()
    for piece in ref.source.pieces(BufferRing(8 * MiB, count=3)):
        saved.update(piece)
    assert saved.digest() == expected


def test_release_shared_under_unmaps_a_folders_shared_copies_and_keeps_their_bytes_written_ones_included(tmp_path):
    from ptdstream.system.pagecache import release_shared_under
    from ptdstream.weightless.mapped_copy import mapped_copy

    (tmp_path / "ours").mkdir()
    data = torch.randint(-128, 128, (6 * MiB + 123,), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    copy = mapped_copy(data, str(tmp_path / "ours"))
    other = mapped_copy(data, str(tmp_path))  # a shared mapping of a file in another folder
    _, checkpoint, _ = _cold_checkpoint(tmp_path / "ours", 2 * MiB)  # a private (copy-on-write) mapping there
    assert file_mapping(checkpoint.data_ptr(), 2 * MiB) is not None
    checkpoint[7] = (int(checkpoint[7]) + 1) % 256
    written = checkpoint.clone()
    for t in (copy, other):
        assert int(t.to(torch.int64).sum()) == int(data.to(torch.int64).sum())  # every page read
    copy[5] = 7  # a shared mapping writes its file: DONTNEED keeps the write
    assert mapping_rss(copy.data_ptr()) >= 6 * MiB
    advised = release_shared_under(str(tmp_path / "ours"))
    assert advised == copy.untyped_storage().nbytes() + (-copy.untyped_storage().nbytes()) % 4096
    assert mapping_rss(copy.data_ptr()) == 0
    assert mapping_rss(other.data_ptr()) >= 6 * MiB  # another folder's: left alone
    assert torch.equal(checkpoint, written)  # a private mapping: left alone, its written page kept
    want = data.clone()
    want[5] = 7
    assert torch.equal(copy, want)  # mapped in again from the page cache
