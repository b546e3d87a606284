"""A manifest whose tables are shared by many offsets is refused in bounded work."""

from __future__ import annotations

import time
import tracemalloc

import flatbuffers
import pytest

from ptdstream import FormatError
from ptdstream.check.manifest import IDENTIFIER, from_bytes
from ptdstream.check.manifest_fb import FileEntry as FE
from ptdstream.check.manifest_fb import Manifest as M
from ptdstream.check.manifest_fb import Section as S
from ptdstream.cli import main as cli_main


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
    fname, kind = b.CreateString("w.ptd"), b.CreateString("ptd")
    FE.FileEntryStart(b)
    FE.FileEntryAddName(b, fname)
    FE.FileEntryAddKind(b, kind)
    FE.FileEntryAddSize(b, 1)
    FE.FileEntryAddPieceSize(b, 1 << 23)
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
    start = time.perf_counter()
    with pytest.raises(FormatError, match=r"manifest describes more entries than its \d+ bytes can hold"):
        from_bytes(data, "hostile")
    seconds = time.perf_counter() - start
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
