"""File-backed delegate blobs: an engine handed over as processed_bytes stays in its file until the save streams it."""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import sys

import pytest
import torch
from conftest import Mlp, mapped_rss, read_folder, reference_files

import ptdstream
from ptdstream.hooks.blobs import FileBlob, delegate_blobs_from_files, file_blob

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from engine_backend import EnginePartitioner


def _lower(engine_dir):
    from executorch.exir import to_edge_transform_and_lower

    torch.manual_seed(0)
    model = Mlp(256, 512, 64).eval()
    programs = {
        "forward": torch.export.export(model, (torch.randn(1, 256),)),
        "prefill": torch.export.export(model, (torch.randn(8, 256),)),
    }
    edge = to_edge_transform_and_lower(programs, partitioner=[EnginePartitioner(str(engine_dir), engine_as_blob=True)])
    return edge.to_executorch()


def test_file_blob_export_equals_bytes_blob_export(tmp_path, monkeypatch):
    from executorch.exir._serialize._cord import FileBackedData

    engine_dir = tmp_path / "engines"  # the same path both times: it is in the compile specs
    with monkeypatch.context() as m:  # upstream's way: the engine read into bytes
        m.setattr(ptdstream, "file_blob", lambda path, sha256=None: open(path, "rb").read())  # the example's name
        upstream = reference_files(_lower(engine_dir), str(tmp_path / "up"))
    with delegate_blobs_from_files():
        manager = _lower(engine_dir)
    data = [d.data for d in manager._emitter_output.program.backend_delegate_data]
    assert data and all(isinstance(b, FileBlob) for b in data)
    assert len({b._path for b in data}) == 1, "both methods built the same engine"
    assert mapped_rss(data[0]._path) == 0, "the emitter used the blob's digest, not its mapping"

    def no_bytes_copy(self):
        raise AssertionError("a delegate blob was loaded into Python bytes")

    monkeypatch.setattr(FileBackedData, "to_bytes", no_bytes_copy)
    out = tmp_path / "out"
    out.mkdir()
    ptdstream.save(manager, str(out / "model.pte"))
    assert read_folder(str(out)) == upstream
    assert reference_files(manager, str(tmp_path / "slow")) == upstream, "upstream's writer, same manager"


def test_without_the_context_torch_refuses_the_blob(tmp_path):
    from torch._export.verifier import SpecViolationError

    with pytest.raises(SpecViolationError, match=r"processed_bytes\(bytes\) : <class '[\w.]*FileBlob'>"):
        _lower(tmp_path / "engines")


def test_context_is_scoped():
    from ptdstream.upstream import adapter as _upstream

    verifier, emitter = _upstream.export_verifier_module(), _upstream.emitter_module()
    real = emitter._Emitter._emit_delegate
    with delegate_blobs_from_files():
        with delegate_blobs_from_files():
            assert isinstance(file_blob.__doc__.encode(), verifier.bytes)
        assert "bytes" in vars(verifier)
    assert "bytes" not in vars(verifier) and emitter._Emitter._emit_delegate is real


def test_file_blob_behaves_like_its_bytes(tmp_path):
    path = tmp_path / "engine.bin"
    data = os.urandom(10_000)
    path.write_bytes(data)
    blob = file_blob(path)
    same = file_blob(path)
    assert len(blob) == 10_000 and blob == data and blob == same and not blob != same
    assert blob != data[:-1] + bytes([data[-1] ^ 0xFF]) and hash(blob) == hash(same)  # always another last byte
    assert {blob: 1}[same] == 1, "usable as a dict key by content, as upstream keys segments"
    assert hashlib.sha256(blob).digest() == blob.sha256() == hashlib.sha256(data).digest()
    assert copy.deepcopy(blob) is blob and pickle.loads(pickle.dumps(blob)) == data
    assert blob.prefix(4) == data[:4]
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert file_blob(empty) == b""
    with pytest.raises(FileNotFoundError):
        file_blob(tmp_path / "missing.bin")
