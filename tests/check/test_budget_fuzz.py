"""Fuzz the readers that take hostile files with a budget per input: `verify
--manifest` (the manifest parser), `extract --list` on packed files and `unpack`
must each end (a result or FormatError/IntegrityError) within a time and memory
budget, whatever the input claims. Memory is Python's traced peak (tracemalloc:
every bytes object the readers allocate, decompressed frames included)."""

from __future__ import annotations

import os
import struct
import tempfile
import time
import tracemalloc

import flatbuffers
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ptdstream import FormatError, IntegrityError
from ptdstream.format.identity import ExtendedHeader
from ptdstream.manifest.codec import IDENTIFIER, FileManifest, IntegrityManifest, SectionEntry, from_bytes, to_bytes
from ptdstream.manifest.manifest_fb import FileEntry as FE
from ptdstream.manifest.manifest_fb import Manifest as M
from ptdstream.manifest.manifest_fb import Section as S
from ptdstream.pack import PackedArtifact, pack, unpack

pytestmark = pytest.mark.fuzz
BUDGET = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OURS = (FormatError, IntegrityError)
SECONDS = 2.0  # CPU seconds per input
MIB = 1 << 20


def within_budget(fn, *, max_seconds: float, max_nbytes: int):
    """Run ``fn`` twice: timed, then with tracemalloc (which slows Python down);
    assert each budget; return its result or our error."""

    def run():
        try:
            return fn()
        except OURS as e:
            return e

    start = time.process_time()  # CPU seconds (every thread's): the work done, not the machine's load
    result = run()
    seconds = time.process_time() - start
    assert seconds < max_seconds, f"{seconds:.2f} CPU s"
    tracemalloc.start()
    try:
        run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < max_nbytes, f"peak {peak / MIB:.1f} MiB"
    return result


# ---------------------------------------------------------------- verify --manifest


def shared_manifest(sections: int, files: int, name: str) -> bytes:
    b = flatbuffers.Builder(256)
    text = b.CreateString(name)
    S.SectionStart(b)
    S.SectionAddName(b, text)
    section = S.SectionEnd(b)
    FE.FileEntryStartSectionsVector(b, sections)
    for _ in range(sections):
        b.PrependUOffsetTRelative(section)
    vec = b.EndVector()
    FE.FileEntryStart(b)
    FE.FileEntryAddName(b, text)
    FE.FileEntryAddPieceSize(b, 1)
    FE.FileEntryAddSections(b, vec)
    entry = FE.FileEntryEnd(b)
    M.ManifestStartFilesVector(b, files)
    for _ in range(files):
        b.PrependUOffsetTRelative(entry)
    fvec = b.EndVector()
    M.ManifestStart(b)
    M.ManifestAddFiles(b, fvec)
    b.Finish(M.ManifestEnd(b), file_identifier=IDENTIFIER)
    return bytes(b.Output())


VALID = to_bytes(IntegrityManifest((FileManifest(
    "model.pte", "pte", 12000, 4096, (b"\x01" * 16,) * 3,
    tuple(SectionEntry(f"s{i}", None, i * 100, 100) for i in range(5)), (("k", 10, b"\x02" * 16),)),)))


@BUDGET
@given(sections=st.integers(0, 5000), files=st.integers(0, 1000), name=st.text(max_size=300))
@example(sections=1000, files=1000, name="segment")  # the 8 KB manifest (85 s, 516 MB before)
@example(sections=5000, files=1000, name="")
def test_manifest_with_shared_tables(sections, files, name):
    data = shared_manifest(sections, files, name)
    within_budget(lambda: from_bytes(data, "m"), max_seconds=SECONDS, max_nbytes=16 * MIB + 64 * len(data))


@BUDGET
@given(edits=st.lists(st.tuples(st.integers(0, len(VALID) - 4), st.sampled_from(
    [0, 1, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 8, 12, 16])), min_size=1, max_size=6))
def test_manifest_with_hostile_words(edits):
    data = bytearray(VALID)
    for offset, word in edits:
        struct.pack_into("<I", data, offset, word)
    data = bytes(data)
    within_budget(lambda: from_bytes(data, "m"), max_seconds=SECONDS, max_nbytes=16 * MIB)


# ---------------------------------------------------------------- extract --list, unpack


def packed(d: str, head: bytes, nbytes: int, frame_nbytes: int) -> str:
    """``head`` then zeros up to ``nbytes`` (a sparse file), packed."""
    src, zst = os.path.join(d, "in"), os.path.join(d, "in.zst")
    with open(src, "wb") as f:
        f.write(head)
        f.truncate(max(nbytes, len(head)))
    pack(src, zst, frame_nbytes=frame_nbytes, level=1)
    os.unlink(src)
    return zst


claims = st.integers(0, 96 * MIB)


@BUDGET
@given(nbytes=st.integers(64, 48 * MIB), program=claims, base=claims, data=claims,
       ident=st.sampled_from([b"ET12", b"FT01"]), frame_nbytes=st.sampled_from([4096, MIB, 8 * MIB, 32 * MIB]))
@example(nbytes=48 * MIB, program=48 * MIB - 64, base=48 * MIB - 64, data=0, ident=b"ET12", frame_nbytes=32 * MIB)
@example(nbytes=48 * MIB, program=4096, base=4096, data=48 * MIB - 4096, ident=b"ET12", frame_nbytes=4096)
def test_extract_list_of_packed_files_with_hostile_headers(nbytes, program, base, data, ident, frame_nbytes):
    head = b"\0" * 4 + ident + ExtendedHeader(program, base, data).to_bytes() + b"\0" * 24
    with tempfile.TemporaryDirectory() as d:
        zst = packed(d, head, nbytes, frame_nbytes)

        def list_it():
            with PackedArtifact(zst, max_metadata_nbytes=8 * MIB) as art:
                return art.artifact

        # the metadata limit (8 MiB) plus an 8 MiB piece of a large frame and its slices
        within_budget(list_it, max_seconds=4 * SECONDS, max_nbytes=40 * MIB)


@BUDGET
@given(nbytes=st.integers(0, 64 * MIB), frame_nbytes=st.sampled_from([4096, MIB, 8 * MIB, 64 * MIB]),
       flip=st.one_of(st.none(), st.tuples(st.integers(0, 4000), st.integers(1, 255))))
@example(nbytes=64 * MIB, frame_nbytes=64 * MIB, flip=None)
@example(nbytes=64 * MIB, frame_nbytes=64 * MIB, flip=(100, 1))
def test_unpack_of_large_frames_and_flips(nbytes, frame_nbytes, flip):
    with tempfile.TemporaryDirectory() as d:
        zst = packed(d, b"\0" * 4 + b"XXXX", nbytes, frame_nbytes)
        if flip is not None:
            with open(zst, "r+b") as f:
                size = os.path.getsize(zst)
                f.seek(flip[0] % size)
                byte = f.read(1)
                f.seek(flip[0] % size)
                f.write(bytes([byte[0] ^ flip[1]]))
        out = os.path.join(d, "out")
        # two decoded 8 MiB frames, or one compressed frame and 8 MiB pieces
        result = within_budget(lambda: unpack(zst, out), max_seconds=4 * SECONDS, max_nbytes=40 * MIB)
        if not isinstance(result, Exception):
            assert os.path.getsize(out) == max(nbytes, 8)
        else:
            assert not os.path.exists(out)
