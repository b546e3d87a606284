"""Engine-style backend: engines written to files, stored once, streamed, never held as bytes."""

from __future__ import annotations

import os
import sys

import torch
from conftest import Mlp, read_folder, reference_files, skip_unless_pages_can_drop

import ptdstream
from ptdstream.format.reader import read_artifact
from ptdstream.system.pagecache import resident_nbytes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from engine_backend import EnginePartitioner


def test_engines_are_stored_once_streamed_and_identical(tmp_path, monkeypatch):
    skip_unless_pages_can_drop(tmp_path)
    from executorch.exir import to_edge_transform_and_lower
    from executorch.exir._serialize._cord import FileBackedData

    torch.manual_seed(0)
    model = Mlp(256, 512, 64).eval()
    programs = {
        "forward": torch.export.export(model, (torch.randn(1, 256),)),
        "prefill": torch.export.export(model, (torch.randn(8, 256),)),
    }
    engine_dir = tmp_path / "engines"
    edge = to_edge_transform_and_lower(programs, partitioner=[EnginePartitioner(str(engine_dir))])
    manager = edge.to_executorch()
    engines = sorted(engine_dir.iterdir())
    assert len(engines) == 1, "both methods built the same engine"
    engine_nbytes = sum(p.numel() * 4 for p in model.parameters())
    assert engines[0].stat().st_size == engine_nbytes

    def no_bytes_copy(self):
        raise AssertionError("an engine was loaded into Python bytes")

    monkeypatch.setattr(FileBackedData, "to_bytes", no_bytes_copy)
    out = tmp_path / "out"
    out.mkdir()
    report = ptdstream.save(manager, str(out / "model.pte"))
    assert resident_nbytes(str(engines[0])) <= 64 << 10, "the engine's pages were dropped"
    ref = reference_files(manager, str(tmp_path / "ref"))
    assert read_folder(str(out)) == ref
    art = read_artifact(str(out / "engines.ptd"))
    assert len(art.segments) == 1 and art.segments[0].nbytes == engine_nbytes
    assert [k for k in art.keys] == [f"engine:{engines[0].stem}"]
    assert report.files[0].payload_nbytes == engine_nbytes
