"""After install(), manager.write_to_file(f) gives upstream's bytes for every kind
of file object upstream's write_to_file accepts."""

from __future__ import annotations

import io
import os
import tempfile
import threading

import pytest
import torch
import zstandard
from conftest import Mlp, export

from ptdstream.hooks import install as patch


@pytest.fixture(scope="module")
def manager_and_reference():
    torch.manual_seed(0)
    manager = export(Mlp(d_hidden=2048))  # constants in the .pte: 512 KiB in several segments
    buf = io.BytesIO()
    manager.write_to_file(buf)  # upstream's own method: not installed yet
    return manager, buf.getvalue()


def routed(manager, f) -> None:
    with patch.installed():
        manager.write_to_file(f)


class WriteOnly:
    """Only ``write``; keeps every object it is given (no copy) and returns nothing."""

    def __init__(self) -> None:
        self.pieces = []

    def write(self, data):
        self.pieces.append(data)


def _read_back(f) -> bytes:
    f.flush()
    f.seek(0)
    return f.read()


def _temporary_file(manager, tmp_path):
    with tempfile.TemporaryFile(dir=tmp_path) as f:  # f.name is a descriptor number
        assert isinstance(f.name, int)
        routed(manager, f)
        return _read_back(f)


def _named_temporary_file(manager, tmp_path):
    with tempfile.NamedTemporaryFile(dir=tmp_path, suffix=".pte") as f:
        routed(manager, f)
        return _read_back(f)


def _spooled(manager, tmp_path):
    with tempfile.SpooledTemporaryFile(max_size=1000) as f:
        routed(manager, f)
        return _read_back(f)


def _bytesio(manager, tmp_path):
    f = io.BytesIO()
    routed(manager, f)
    return f.getvalue()


def _unbuffered_fileio(manager, tmp_path):
    path = tmp_path / "raw.bin"
    with open(path, "wb", buffering=0) as f:  # io.FileIO: raw, may write short
        routed(manager, f)
    return path.read_bytes()


def _descriptor_file(manager, tmp_path):
    fd = os.open(tmp_path / "fd.bin", os.O_WRONLY | os.O_CREAT)
    with os.fdopen(fd, "wb") as f:  # name is the descriptor number
        routed(manager, f)
    return (tmp_path / "fd.bin").read_bytes()


def _write_only_wrapper(manager, tmp_path):
    f = WriteOnly()
    routed(manager, f)
    return b"".join(bytes(p) for p in f.pieces)


def _zstd_stream(manager, tmp_path):
    sink = io.BytesIO()
    writer = zstandard.ZstdCompressor().stream_writer(sink, closefd=False)
    routed(manager, writer)
    writer.flush(zstandard.FLUSH_FRAME)
    return zstandard.ZstdDecompressor().decompress(sink.getvalue(), max_output_size=1 << 30)


def _pipe(manager, tmp_path):
    r, w = os.pipe()  # unseekable; the reader runs while the writer writes
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(r, 1 << 16), b"")))
    reader.start()
    try:
        with open(w, "wb") as f:
            routed(manager, f)
    finally:
        reader.join(30)
        os.close(r)
    return b"".join(chunks)


KINDS = {f.__name__.lstrip("_"): f for f in (
    _temporary_file, _named_temporary_file, _spooled, _bytesio, _unbuffered_fileio, _descriptor_file,
    _write_only_wrapper, _zstd_stream, _pipe)}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_write_to_file_gives_upstreams_bytes(manager_and_reference, tmp_path, kind):
    manager, reference = manager_and_reference
    assert KINDS[kind](manager, tmp_path) == reference
