"""Large cases: a 256 MiB delegate blob (C1) and segments past 4 GiB (C3), in bounded memory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from conftest import export, reference_files

import ptdstream

pytestmark = pytest.mark.slow


def _rss_nbytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_added(fn):
    """Run ``fn``; return (its result, peak RSS above the RSS just before it, bytes)."""
    before = _rss_nbytes()
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_nbytes())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = fn()
    finally:
        done.set()
        thread.join()
    peak[0] = max(peak[0], _rss_nbytes())
    return result, peak[0] - before


def test_c1_256_mib_delegate_blob_saved_in_bounded_memory(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8192, 8192, bias=False)
    manager = export(model, xnnpack=True, inputs=(torch.randn(1, 8192),))
    del model
    out = tmp_path / "out"
    out.mkdir()
    report, added = peak_rss_added(lambda: ptdstream.save(manager, str(out / "model.pte")))
    assert report.nbytes > 256 << 20
    assert added < 64 << 20, f"save added {added / 2**20:.0f} MiB of RSS"
    ref = reference_files(manager, str(tmp_path / "ref"))
    with open(out / "model.pte", "rb") as f:
        assert f.read() == ref["model.pte"]


SCRIPT = textwrap.dedent(
    """
    import os, sys
    import executorch.extension.flat_tensor.serialize.serialize  # imports torch: not the save's memory
    from ptdstream import FileRangeSource, StreamingNamedDataStore
    from ptdstream.save import write_data_files
    path, out = sys.argv[1], sys.argv[2]
    def rss():
        with open("/proc/self/status") as f:
            return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(("VmRSS", "VmHWM"))}
    before = rss()["VmRSS"]
    store = StreamingNamedDataStore()
    store.add_named_data("big", FileRangeSource(path), alignment=16, external_tag="big")
    store.add_named_data("tail", b"after four gibibytes", alignment=48, external_tag="big")
    write_data_files(store, out)
    print(rss()["VmHWM"] - before)
    """
)


def test_c3_segments_past_4_gib_from_a_sparse_file(tmp_path):
    from executorch.exir._serialize._cord import FileBackedData
    from executorch.exir._serialize._named_data_store import NamedDataStore
    from executorch.exir._serialize.data_serializer import DataPayload
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    from ptdstream.check.compare import cord_pieces

    sparse = tmp_path / "sparse.bin"
    size = (9 << 30) // 2  # 4.5 GiB, never in memory
    free = shutil.disk_usage(tmp_path).free
    if free < size + (1 << 30):  # the .ptd is written whole (the sparse input takes no space)
        pytest.skip(f"{tmp_path} has {free / 2**30:.1f} GiB free; the 4.5 GiB .ptd needs 5.5")
    with open(sparse, "wb") as f:
        f.truncate(size)
        f.seek(size - 32)
        f.write(b"the last 32 bytes of 4.5 GiB...!")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(sparse), str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    added = int(proc.stdout.strip().splitlines()[-1])
    assert added < 96 << 20, f"peak RSS grew by {added / 2**20:.0f} MiB"
    written = out / "big.ptd"
    # The reference's bytes, streamed from its Cord and compared piece by piece.
    upstream = NamedDataStore()
    upstream.add_named_data("big", FileBackedData(str(sparse)), alignment=16, external_tag="big")
    upstream.add_named_data("tail", b"after four gibibytes", alignment=48, external_tag="big")
    data = upstream.get_named_data_store_output()
    cord = FlatTensorSerializer().serialize(
        DataPayload(buffers=data.buffers, named_data=data.external_data["big"])
    )
    assert os.path.getsize(written) == len(cord)
    with open(written, "rb") as f:
        for piece in cord_pieces(cord, 64 << 20):
            assert f.read(len(piece)) == bytes(piece)
    with open(written, "rb") as f:
        head = f.read(48)
    base = int.from_bytes(head[32:40], "little")
    tail_offset = base + ((size + 383) // 384) * 384
    assert tail_offset > 1 << 32
    with open(written, "rb") as f:
        f.seek(tail_offset)
        assert f.read(20) == b"after four gibibytes"
    os.remove(written)
