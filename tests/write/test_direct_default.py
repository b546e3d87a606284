"""brk2: direct=True still gives the bytes of the buffered default, and falls back on tmpfs."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from ptdstream import StreamingNamedDataStore
from ptdstream.hooks.cuda.spill import SpillFile
from ptdstream.save import write_data_files
from ptdstream.sources import MemorySource


def _store(spill):
    store = StreamingNamedDataStore()
    for i, n in enumerate([0, 1, 4095, 4097, (8 << 20) + 3, 70_001]):
        data = bytes([i + 1]) * n if n else b""
        src = spill.append(MemorySource(data), f"k{i}") if i % 2 else data
        store.add_named_data(f"k{i}", src, alignment=64, external_tag="w" if i % 3 else "x")
    return store


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_brk2_direct_and_buffered_give_the_same_files(tmp_path, where):
    if where == "tmpfs":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        base = tempfile.mkdtemp(dir="/dev/shm")
    else:
        base = str(tmp_path)
    try:
        spill = SpillFile(str(tmp_path))
        outs = {}
        for direct in (False, True):
            folder = os.path.join(base, f"d{int(direct)}")
            os.mkdir(folder)
            write_data_files(_store(spill), folder, direct=direct, chunk_nbytes=1 << 20)
            outs[direct] = {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}
        assert list(outs[True]) == ["w.ptd", "x.ptd"]
        assert outs[True] == outs[False]
    finally:
        if where == "tmpfs":
            shutil.rmtree(base)
