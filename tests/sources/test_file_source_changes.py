"""A file source changed while a save reads it (rewritten in place, truncated or
replaced between two of its ranges) is refused naming the key and the file, and
nothing is published; a save whose file source is its own output writes the bytes it
read (the README's claim 7)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import read_folder as read_all

from ptdstream.errors import IntegrityError
from ptdstream.save import write_data_files
from ptdstream.sources import file as file_sources
from ptdstream.sources.file import FileRangeSource
from ptdstream.store import StreamingNamedDataStore

# --- claim 7: a file-backed source changed while the save reads it ---------------------------------------------


def _rewrite(src):
    with open(src, "r+b") as f:  # in place, one byte past the first 32 of key b
        f.seek(9000)
        f.write(b"X")


def _truncate(src):
    os.truncate(src, 9000)


def _replace(src):
    with open(src + ".new", "wb") as f:
        f.write(b"Y" * 16384)
    os.replace(src + ".new", src)


@pytest.mark.parametrize("change, message", [
    (_rewrite, "changed while it was read"),
    (_truncate, "ended at offset 9000, expected 8192 bytes from offset 8192"),
    (_replace, "replaced before it was read"),
], ids=["rewritten-in-place", "truncated", "replaced"])
def test_a_file_source_changed_between_two_of_its_ranges_is_refused(tmp_path, monkeypatch, change, message):
    """Two keys read from two ranges of one file; the file changes after the first
    is written: IntegrityError naming the file and key b, the old target kept, no temp."""
    src = str(tmp_path / "blob.bin")
    with open(src, "wb") as f:
        f.write(os.urandom(16384))
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.ptd").write_bytes(b"previous")
    store = StreamingNamedDataStore()
    store.add_named_data("a", FileRangeSource(src, 0, 8192), alignment=16, external_tag="model")
    store.add_named_data("b", FileRangeSource(src, 8192, 8192), alignment=16, external_tag="model")
    original, calls = file_sources.FileRangeSource.pieces, [0]

    def pieces(self, ring):
        calls[0] += 1
        if calls[0] == 2:
            change(src)
        yield from original(self, ring)

    monkeypatch.setattr(file_sources.FileRangeSource, "pieces", pieces)
    with pytest.raises(IntegrityError) as e:
        write_data_files(store, str(out))
    assert "named data (key 'b') of model.ptd" in str(e.value) and f"file {src}: " in str(e.value)
    assert message in str(e.value) and str(e.value).endswith("nothing was published")
    assert read_all(out) == {"model.ptd": b"previous"}


def test_a_save_whose_file_source_is_its_own_output_writes_the_bytes_read(tmp_path):
    """The library replaces (as upstream does): a key read from out/model.ptd while
    out/model.ptd is written gets the old file's bytes, the new file is whole."""
    out = tmp_path / "out"
    out.mkdir()
    old = os.urandom(4096)
    (out / "model.ptd").write_bytes(old)
    store = StreamingNamedDataStore()
    store.add_named_data("a", FileRangeSource(str(out / "model.ptd"), 100, 1000), alignment=16, external_tag="model")
    store.add_named_data("b", torch.arange(10.0), alignment=16, external_tag="model")
    write_data_files(store, str(out))
    ref_store = StreamingNamedDataStore()
    ref_store.add_named_data("a", old[100:1100], alignment=16, external_tag="model")
    ref_store.add_named_data("b", torch.arange(10.0), alignment=16, external_tag="model")
    (tmp_path / "ref").mkdir()
    write_data_files(ref_store, str(tmp_path / "ref"))
    assert read_all(out) == read_all(tmp_path / "ref")
