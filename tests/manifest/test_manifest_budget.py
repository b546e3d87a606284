"""A manifest whose tables are shared by many offsets is refused in bounded work."""

from __future__ import annotations

import time
import tracemalloc

import flatbuffers
import pytest
from _procs import SAFETY_S

from ptdstream import FormatError
from ptdstream.cli import main as cli_main
from ptdstream.manifest.codec import IDENTIFIER, from_bytes
from ptdstream.manifest.manifest_fb import FileEntry as FE
from ptdstream.manifest.manifest_fb import Manifest as M
from ptdstream.manifest.manifest_fb import Section as S
from ptdstream.manifest.manifest_fb.Digest128 import CreateDigest128


def shared_tables(sections: int, files: int) -> bytes:
    """One section table named ``sections`` times by one file entry, which the
    manifest names ``files`` times: a few KB describing sections * files entries."""
    b = flatbuffers.Builder(1024)
    name = b.CreateString("segment")
    S.SectionStart(b)
    S.SectionAddName(b, name)
    S.SectionAddOffset(b, 0)
    S.SectionAddSize(b, 1)
    section = S.SectionEnd(b)
    FE.FileEntryStartSectionsVector(b, sections)
    for _ in range(sections):
        b.PrependUOffsetTRelative(section)
    section_vec = b.EndVector()
    FE.FileEntryStartPiecesVector(b, 1)  # the one piece of its 1 byte
    CreateDigest128(b, 0, 0)
    pieces = b.EndVector()
    fname, kind = b.CreateString("w.ptd"), b.CreateString("ptd")
    FE.FileEntryStart(b)
    FE.FileEntryAddName(b, fname)
    FE.FileEntryAddKind(b, kind)
    FE.FileEntryAddSize(b, 1)
    FE.FileEntryAddPieceSize(b, 1 << 23)
    FE.FileEntryAddPieces(b, pieces)
    FE.FileEntryAddSections(b, section_vec)
    entry = FE.FileEntryEnd(b)
    M.ManifestStartFilesVector(b, files)
    for _ in range(files):
        b.PrependUOffsetTRelative(entry)
    files_vec = b.EndVector()
    algo = b.CreateString("xxh3-128")
    M.ManifestStart(b)
    M.ManifestAddFiles(b, files_vec)
    M.ManifestAddAlgorithm(b, algo)
    M.ManifestAddVersion(b, 1)
    b.Finish(M.ManifestEnd(b), file_identifier=IDENTIFIER)
    return bytes(b.Output())


def test_a_legitimately_shaped_small_manifest_still_parses():
    data = shared_tables(3, 2)  # shared, but within what its size can hold
    m = from_bytes(data, "small")
    assert [len(f.sections) for f in m.files] == [3, 3]


@pytest.mark.parametrize("sections,files", [(1000, 1000), (10_000, 4000)])
def test_shared_tables_are_refused_in_bounded_time_and_memory(sections, files):
    data = shared_tables(sections, files)
    assert len(data) < 60_000
    start = time.process_time()  # CPU seconds: the work done, not the machine's load
    with pytest.raises(FormatError, match=r"manifest describes more entries than its \d+ bytes can hold"):
        from_bytes(data, "hostile")
    seconds = time.process_time() - start
    assert seconds < 1.0, seconds  # was 85 s (and 516 MB) for 1000 x 1000
    tracemalloc.start()
    with pytest.raises(FormatError):
        from_bytes(data, "hostile")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_verify_manifest_exits_1_on_shared_tables(tmp_path, capsys):
    (tmp_path / "m.manifest").write_bytes(shared_tables(1000, 1000))
    (tmp_path / "w.ptd").write_bytes(b"x")
    start = time.perf_counter()
    assert cli_main(["verify", str(tmp_path / "w.ptd"), "--manifest", str(tmp_path / "m.manifest")]) == 1
    assert time.perf_counter() - start < 10
    assert "manifest describes more entries" in capsys.readouterr().err


_VERIFY_IN_A_CHILD = r"""
import json, resource, sys, time
from ptdstream.manifest.verify import verify_files
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
report = verify_files(sys.argv[1:-1], sys.argv[-1])
seconds = time.perf_counter() - start
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(json.dumps({"ok": report.ok, "messages": [c.message for c in report.checks], "seconds": seconds,
                  "grown": grown}))
"""


@pytest.mark.parametrize("piece_nbytes", [4 << 30, 1 << 40, 1 << 63, (1 << 64) - 1])
def test_a_lying_piece_size_never_sizes_a_buffer(tmp_path, piece_nbytes):
    """A 2 KB file, its manifest rewritten with a piece size of 4 GiB .. 2^64-1: the
    file is one piece under either size, so the answer is 'matches', given in a
    fraction of a second and a few MiB (it allocated the piece size: 4.1 GiB and
    30 s, MemoryError, OverflowError)."""
    import dataclasses
    import json
    import os
    import subprocess
    import sys

    import ptdstream
    from ptdstream.manifest.codec import to_bytes
    from ptdstream.manifest.describe import write_manifest

    (tmp_path / "w.bin").write_bytes(os.urandom(2048))
    manifest = write_manifest([str(tmp_path / "w.bin")], str(tmp_path / "m.manifest"))
    lying = dataclasses.replace(manifest, files=(dataclasses.replace(manifest.files[0], piece_nbytes=piece_nbytes),))
    (tmp_path / "m.manifest").write_bytes(to_bytes(lying))
    root = os.path.dirname(os.path.dirname(ptdstream.__file__))
    proc = subprocess.run([sys.executable, "-c", _VERIFY_IN_A_CHILD, str(tmp_path / "w.bin"),
                           str(tmp_path / "m.manifest")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=root), timeout=SAFETY_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["ok"] is True
    assert got["messages"] == [f"{tmp_path / 'w.bin'}: matches the manifest (2,048 bytes, 1 piece)"]
    assert got["seconds"] < 1.0, got
    assert got["grown"] < 32 << 20, got


def test_a_changed_byte_is_still_found_when_pieces_are_larger_than_a_read(tmp_path):
    """Pieces of 8 MiB + 3 bytes are read in 8 MiB reads: the digests are the same
    as one read per piece, and a flipped byte in the second piece is named."""
    import os

    import xxhash

    from ptdstream.manifest.describe import write_manifest
    from ptdstream.manifest.verify import verify_manifest

    data = bytearray(os.urandom((8 << 20) * 2 + 100))
    (tmp_path / "w.bin").write_bytes(data)
    piece = (8 << 20) + 3
    manifest = write_manifest([str(tmp_path / "w.bin")], str(tmp_path / "m.manifest"), piece)
    assert manifest.files[0].pieces == tuple(xxhash.xxh3_128(bytes(data[i:i + piece])).digest()
                                             for i in range(0, len(data), piece))
    data[piece + 5] ^= 1
    (tmp_path / "w.bin").write_bytes(data)
    check = verify_manifest(str(tmp_path / "w.bin"), manifest)
    assert not check.ok and check.first_bad_piece == 1 and check.first_bad_offset == (piece + 5) // 4096 * 4096


def test_a_block_size_above_the_ceiling_is_refused(tmp_path):
    import dataclasses

    from ptdstream.manifest.codec import to_bytes
    from ptdstream.manifest.describe import write_manifest

    (tmp_path / "w.bin").write_bytes(b"x" * 100)
    manifest = write_manifest([str(tmp_path / "w.bin")], str(tmp_path / "m.manifest"))
    lying = dataclasses.replace(manifest, files=(dataclasses.replace(manifest.files[0], block_nbytes=1 << 40),))
    with pytest.raises(FormatError, match=r"lying: file entry 0 gives block size 1099511627776 bytes, more than "
                                          r"the 1048576 a manifest may give \(ptdstream writes 4096\); refused"):
        from_bytes(to_bytes(lying), "lying")


def _lie(tmp_path, **change):
    """A real manifest of a 64 KiB file (16 pieces of 4 KiB, 16 blocks, one section
    added), its one entry rewritten with ``change``; its bytes."""
    import dataclasses
    import os

    from ptdstream.manifest.codec import SectionEntry, to_bytes
    from ptdstream.manifest.describe import write_manifest

    (tmp_path / "w.bin").write_bytes(os.urandom(64 << 10))
    manifest = write_manifest([str(tmp_path / "w.bin")], str(tmp_path / "m.manifest"), piece_nbytes=4096)
    entry = dataclasses.replace(manifest.files[0], sections=(SectionEntry("s", "k", 0, 100),),
                                keys=(("k", 100, b"\x00" * 16),))
    entry = dataclasses.replace(entry, **{k: v(entry) if callable(v) else v for k, v in change.items()})
    return to_bytes(dataclasses.replace(manifest, files=(entry,)))


_HINT = ": the manifest does not describe this file (damaged or not written by ptdstream); refused, write it " \
        "again with ptdstream manifest"


@pytest.mark.parametrize("change,message", [
    ({"piece_nbytes": 1}, "piece_size is 1, less than the 4096 bytes a piece may have"),
    ({"piece_nbytes": 4095}, "piece_size is 4095, less than the 4096 bytes a piece may have"),
    ({"block_nbytes": 1}, "block_size is 1, less than the 4096 bytes a block may have (0: no blocks; ptdstream "
                          "writes 4096)"),
    ({"pieces": lambda e: e.pieces[:-1]}, "the count of pieces is 15, not the 16 pieces of 4096 bytes its size "
                                          "65536 needs"),
    ({"piece_nbytes": 8192}, "the count of pieces is 16, not the 8 pieces of 8192 bytes its size 65536 needs"),
    ({"nbytes": 1 << 40}, "the count of pieces is 16, not the 268435456 pieces of 4096 bytes its size "
                          "1099511627776 needs"),
    ({"blocks": lambda e: e.blocks * 2}, "the count of blocks is 32, not the 16 blocks of 4096 bytes its size "
                                         "65536 needs"),
    ({"sections": lambda e: (e.sections[0], type(e.sections[0])("t", None, 65000, 537))},
     "section 1 ('t') offset + size is 65537, past the file's end at 65536"),
    ({"keys": (("k", 65537, b"\x00" * 16),)}, "key 'k' size is 65537, more than the file's size 65536"),
])
def test_a_count_or_size_that_does_not_fit_the_file_is_refused_naming_manifest_file_and_field(
        tmp_path, change, message):
    """Every count and size of a file entry is checked against the file size it gives
    (they were read as given: piece size 1 cost a digest object per byte verified)."""
    data = _lie(tmp_path, **change)
    with pytest.raises(FormatError) as raised:
        from_bytes(data, "lie.manifest")
    assert str(raised.value) == f"lie.manifest: file entry 0 ('w.bin'): {message}{_HINT}"


def test_the_unchanged_entry_of_those_lies_parses(tmp_path):
    m = from_bytes(_lie(tmp_path), "true.manifest")
    assert (m.files[0].nbytes, m.files[0].piece_nbytes, len(m.files[0].pieces), m.files[0].block_nbytes,
            len(m.files[0].blocks)) == (65536, 4096, 16, 4096, 16)


_PEAK_IN_A_CHILD = r"""
import sys, time
from ptdstream.cli import main
start = time.process_time()  # CPU seconds: the work done, not the machine's load
rc = main(sys.argv[1:])
seconds = time.process_time() - start
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print("RESULT", rc, peak // 1024, seconds)
"""


@pytest.mark.parametrize("field", ["piece_nbytes", "block_nbytes"])
def test_verify_against_a_manifest_of_one_byte_pieces_exits_1_at_once_in_bounded_memory(tmp_path, field):
    """A 4 MiB file and its manifest saying piece (or block) size 1: ``verify --manifest``
    exits 1 naming manifest, file and field, before reading the file (it used 325 MiB
    and 40 s: a digest per byte); the peak RSS of the process (VmHWM) stays small."""
    import dataclasses
    import os
    import subprocess
    import sys

    import ptdstream
    from ptdstream.manifest.codec import to_bytes
    from ptdstream.manifest.describe import write_manifest

    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(4 << 20))
    real = write_manifest([str(data)], str(tmp_path / "real.manifest"))
    lie = tmp_path / "lie.manifest"
    lie.write_bytes(to_bytes(dataclasses.replace(real, files=(dataclasses.replace(real.files[0], **{field: 1}),))))
    before = (data.read_bytes(), lie.read_bytes())
    root = os.path.dirname(os.path.dirname(ptdstream.__file__))
    proc = subprocess.run([sys.executable, "-c", _PEAK_IN_A_CHILD, "verify", str(data), "--manifest", str(lie)],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=root), timeout=SAFETY_S)
    rc, peak_mib, seconds = proc.stdout.split("RESULT")[1].split()
    what = {"piece_nbytes": "piece_size is 1, less than the 4096 bytes a piece may have",
            "block_nbytes": "block_size is 1, less than the 4096 bytes a block may have (0: no blocks; "
                            "ptdstream writes 4096)"}[field]
    assert int(rc) == 1
    assert proc.stderr.strip() == f"ptdstream: invalid file: {lie}: file entry 0 ('data.bin'): {what}{_HINT}"
    assert int(peak_mib) < 100, peak_mib
    assert float(seconds) < 5, seconds
    assert (data.read_bytes(), lie.read_bytes()) == before


def test_ptdstream_never_writes_pieces_below_the_minimum(tmp_path, capsys):
    from ptdstream.manifest.describe import describe_file

    (tmp_path / "w.bin").write_bytes(b"x" * 10000)
    assert cli_main(["manifest", str(tmp_path / "w.bin"), "--piece-size", "4095", "-o", str(tmp_path / "m")]) == 2
    assert capsys.readouterr().err.strip() == ("ptdstream manifest: --piece-size must be at least 4096 "
                                               "(bytes), got 4095")
    assert not (tmp_path / "m").exists()
    with pytest.raises(ValueError, match=r"w.bin: piece size 1024 is below the 4096 bytes a manifest piece may have"):
        describe_file(str(tmp_path / "w.bin"), 1024)
    assert cli_main(["manifest", str(tmp_path / "w.bin"), "--piece-size", "4096", "-o", str(tmp_path / "m"),
                     "-q"]) == 0
    assert len(from_bytes((tmp_path / "m").read_bytes()).files[0].pieces) == 3
