"""What a source must prove at write time is data (a frozen ``Expectation``) given
when it is built or handed over, and a source says itself whether it is mutable;
no module sets attributes on another's sources."""

from __future__ import annotations

import ast
import dataclasses
import os
import pathlib

import pytest
import torch
import xxhash

import ptdstream
from ptdstream import StreamingNamedDataStore
from ptdstream.errors import IntegrityError
from ptdstream.save import write_data_files
from ptdstream.sources import FileRangeSource, MemorySource, Source, TensorSource
from ptdstream.sources.base import NO_EXPECTATION, Expectation
from ptdstream.sources.fingerprint import ALGO, Fingerprint

PACKAGE = pathlib.Path(ptdstream.__file__).parent


class Writable(Source):
    """A new kind of source over a caller's bytearray that says nothing about mutability."""

    def __init__(self, data: bytearray) -> None:
        self._data = data
        self.nbytes = len(data)
        self.reads = 0

    def describe(self) -> str:
        return "a writable thing"

    def prefix(self, nbytes: int = 32) -> bytes:
        return bytes(self._data[:nbytes])

    def pieces(self, ring):
        self.reads += 1
        view = memoryview(self._data)
        for start in range(0, self.nbytes, ring.chunk_nbytes):
            yield view[start : start + ring.chunk_nbytes]


def _xxh(data) -> Fingerprint:
    return Fingerprint(len(data), ALGO, xxhash.xxh3_128(bytes(data)).digest())


def test_expectation_is_frozen_and_empty_by_default():
    assert Source.is_mutable.fget is not None  # a property every class may answer
    assert MemorySource(b"abc").expectation is NO_EXPECTATION
    assert NO_EXPECTATION == Expectation(fingerprint=None, gpu_fingerprint=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        NO_EXPECTATION.fingerprint = _xxh(b"x")  # type: ignore[misc]  # the point of the test


def test_a_new_source_type_is_mutable_unless_it_says_otherwise_and_is_digested_at_hand_over(tmp_path):
    data = bytearray(b"\x07" * 5000)
    source = Writable(data)
    assert source.is_mutable is True
    store = StreamingNamedDataStore()
    store.add_named_data("w", source, alignment=16, external_tag="t")
    assert source.reads == 1
    assert source.expectation.fingerprint == _xxh(b"\x07" * 5000)
    data[4000] = 9  # after hand-over, before the write
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(IntegrityError) as e:
        write_data_files(store, str(out))
    msg = str(e.value)
    assert "'w'" in msg and "t.ptd" in msg and "a writable thing changed after it was handed over" in msg
    handed_over = _xxh(b"\x07" * 5000).hex
    assert f"!= {handed_over} when handed over" in msg
    assert os.listdir(out) == []


def test_which_sources_are_digested_at_hand_over(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"f" * 100)
    assert MemorySource(b"immutable").hand_over().expectation.fingerprint is None
    assert FileRangeSource(str(path)).hand_over().expectation.fingerprint is None
    buf = bytearray(b"mutable bytes")
    assert MemorySource(buf).hand_over().expectation.fingerprint == _xxh(buf)
    t = torch.arange(10, dtype=torch.int32)
    assert TensorSource(t).hand_over().expectation.fingerprint == _xxh(t.numpy().tobytes())


def test_hand_over_keeps_the_first_fingerprint_and_records_a_given_one_once():
    buf = bytearray(b"first")
    source = MemorySource(buf)
    given = _xxh(b"given by the caller")
    assert source.hand_over(given) is source
    assert source.expectation.fingerprint == given
    source.hand_over()
    source.hand_over(_xxh(b"another"))
    assert source.expectation.fingerprint == given
    # An immutable source records a digest the caller gives (the emitter's pass over a mapping).
    mapped = MemorySource(b"bytes")
    assert mapped.hand_over(given).expectation.fingerprint == given


def test_a_freed_tensor_is_refused_at_hand_over_naming_it():
    t = torch.zeros(64, dtype=torch.float32)
    source = TensorSource(t, label="key 'x'")
    t.untyped_storage().resize_(0)
    with pytest.raises(IntegrityError, match=r"key 'x' float32\[64\]: its storage holds 0 bytes, 256 needed"):
        source.hand_over()


def test_a_cuda_source_is_given_its_gpu_fingerprint_and_takes_no_host_digest_at_hand_over():
    from ptdstream.sources.cuda import CudaTensorSource

    gpu = Fingerprint(16, "gpu-test", b"\x01" * 16)
    t = torch.arange(4, dtype=torch.int32)  # built on the CPU: nothing here reads it
    source = CudaTensorSource(t, label="w", expectation=Expectation(gpu_fingerprint=gpu))
    assert source.hand_over() is source
    assert source.expectation == Expectation(gpu_fingerprint=gpu)
    assert source.gpu_fingerprint() is gpu  # served from the expectation, not computed
    assert CudaTensorSource(t).expectation is NO_EXPECTATION


def test_a_spilled_source_is_built_with_its_digest_and_origin_fingerprint(tmp_path):
    from ptdstream.hooks.cuda.spill import SpillFile

    gpu = Fingerprint(10, "gpu-test", b"\x02" * 16)
    spill = SpillFile(str(tmp_path))
    spilled = spill.append(MemorySource(bytearray(b"0123456789")), "s", gpu_fingerprint=gpu)
    assert spilled.expectation == Expectation(fingerprint=_xxh(b"0123456789"), gpu_fingerprint=gpu)
    assert spilled.gpu_fingerprint() is gpu
    assert spill.append(MemorySource(b"abc"), "t").gpu_fingerprint() is None
    assert os.listdir(tmp_path) == []


def test_source_backed_data_is_built_with_the_sha256_it_is_handed():
    from ptdstream.hooks.interop import SourceBackedData
    from ptdstream.upstream import adapter

    class Unreadable(MemorySource):
        def pieces(self, ring):
            raise AssertionError("read")

    data = SourceBackedData(Unreadable(b"abc"), sha256=b"\x05" * 32)
    assert adapter.cached_sha256(data) == b"\x05" * 32
    assert data.sha256() == b"\x05" * 32
    assert adapter.cached_sha256(SourceBackedData(b"abc")) is None


# --- no module sets attributes on sources -------------------------------------------------


def _trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_fb" not in path.parent.name:
            yield path, ast.parse(path.read_text(), str(path))


#: What a source must prove at write time, under every name it has had: always checked.
INTEGRITY_NAMES = {"_expectation", "expectation", "_gpu_fingerprint", "expected_fingerprint", "stands_for",
                   "verify_on_write", "is_mutable"}


def _class_attribute_names(node: ast.ClassDef):
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                and isinstance(sub.value, ast.Name) and sub.value.id == "self":
            names.add(sub.attr)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(sub.name)
    for stmt in node.body:
        for target in getattr(stmt, "targets", [getattr(stmt, "target", None)]):
            if isinstance(target, ast.Name):
                names.add(target.id)
    return names - {"__init__"}


def _source_attribute_names():
    """The ``Source`` subclasses of the package and the attribute names only they
    define or set on ``self`` (names other classes share, such as ``nbytes`` or
    ``offset``, are left out), plus :data:`INTEGRITY_NAMES`."""
    classes = {}
    for _path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)
    sources, grew = {"Source"}, True
    while grew:
        grew = False
        for name, nodes in classes.items():
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", None) for n in nodes for b in n.bases}
            if name not in sources and bases & sources:
                sources.add(name)
                grew = True
    own = set().union(*(_class_attribute_names(n) for name in sources for n in classes[name]))
    shared = set().union(*(_class_attribute_names(n) for name, nodes in classes.items() if name not in sources
                           for n in nodes))
    return sources, (own - shared) | INTEGRITY_NAMES


def _foreign_stores(names, trees):
    """``obj.name = ...`` (``obj`` not ``self``) and ``setattr(obj, "name", ...)`` for those names."""
    found = []
    for rel, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                    and node.attr in names and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("setattr", "delattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in names:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_sets_attributes_on_a_source_after_it_is_built():
    sources, names = _source_attribute_names()
    assert {"MemorySource", "TensorSource", "CudaTensorSource", "SpilledSource", "DcpTensorSource"} <= sources
    assert {"_expectation", "_gpu_fingerprint", "expectation", "_tensor", "_ring_count"} <= names
    trees = [(path.relative_to(PACKAGE), tree) for path, tree in _trees()]
    assert _foreign_stores(names, trees) == []


def test_the_attribute_check_sees_the_stores_the_package_used_to_make():
    code = (
        "def seal(source):\n    source.expected_fingerprint = fp\n"
        "def keep(source, self):\n    source._gpu_fingerprint = fp\n    self.source.stands_for = fp\n"
        "    setattr(source, '_expectation', fp)\n    self.nbytes = 1\n    digest.hex = 2\n"
    )
    names = INTEGRITY_NAMES | {"nbytes"}
    assert _foreign_stores(names, [("m.py", ast.parse(code))]) == [
        "m.py:2: source.expected_fingerprint", "m.py:4: source._gpu_fingerprint",
        "m.py:5: self.source.stands_for", "m.py:6: setattr(source, '_expectation', fp)",
    ]
