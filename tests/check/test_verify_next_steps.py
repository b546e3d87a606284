"""Verify's answers say what to do next: the ``.ptd`` beside a program checked without
it (and the command), no cross-file check under a file that is no program, a program
compared with a data file, the backends a program's delegates need."""

from __future__ import annotations

import os
import shutil

from _small_exports import write_reference

from ptdstream.weights.write import read_program_weights

EXT_PTD = "_default_external_constant.ptd"


def _verify(capsys, *argv) -> tuple[int, str, str]:
    from ptdstream.cli import main

    code = main(["verify", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_of_a_program_alone_names_the_ptd_beside_it_and_the_command(tmp_path, capsys):
    files = write_reference("external", tmp_path)
    pte, ptd = files["model.pte"], files[EXT_PTD]
    from ptdstream.check.structure import check_structure

    report = check_structure(pte)
    missing = ", ".join(repr(t) for t in read_program_weights(pte).keys)
    assert [c.detail for c in report.problems] == [
        f"no .ptd given; missing: {missing}; {ptd} beside it holds them: ptdstream verify {pte} {ptd}"]
    code, _, err = _verify(capsys, pte, "-q")
    assert (code, err) == (1, f"ptdstream verify: INVALID {pte}: external data: no .ptd given; missing: {missing}; "
                              f"{ptd} beside it holds them: ptdstream verify {pte} {ptd}\n")
    assert check_structure(pte, [ptd]).ok  # the command it gives passes


def test_verify_names_only_the_siblings_that_hold_missing_keys(tmp_path):
    from ptdstream.check.structure import check_structure

    files = write_reference("external", tmp_path / "set")
    pte, ptd = files["model.pte"], files[EXT_PTD]
    write_reference("xnnpack_ptd", tmp_path / "other")  # a .ptd of other keys
    shutil.copyfile(tmp_path / "other" / "model.ptd", tmp_path / "set" / "other.ptd")
    (tmp_path / "set" / "junk.ptd").write_bytes(b"not a ptd")
    detail = check_structure(pte).problems[0].detail
    assert detail.endswith(f"; {ptd} beside it holds them: ptdstream verify {pte} {ptd}")
    os.remove(ptd)
    assert check_structure(pte).problems[0].detail.startswith("no .ptd given; missing: ")
    assert "beside it" not in check_structure(pte).problems[0].detail


def test_verify_of_a_file_that_is_no_program_stops_at_its_parse(tmp_path, capsys):
    """``verify notes.txt model.ptd``: the parse failure, the .ptd's own checks, and no
    'ok notes.txt: keys unique across .ptd files' under a file that is no program."""
    files = write_reference("external", tmp_path)
    (tmp_path / "notes.txt").write_bytes(b"hello notes")
    code, out, _ = _verify(capsys, tmp_path / "notes.txt", files[EXT_PTD])
    lines = out.splitlines()
    assert code == 1 and lines[0] == (f"FAIL {tmp_path / 'notes.txt'}: parse: {tmp_path / 'notes.txt'}: at offset 4: "
                                      "identifier b'o no' is neither ET.. (.pte) nor FT.. (.ptd): not an ExecuTorch "
                                      "file")
    assert not any("notes.txt" in line for line in lines[1:])
    assert lines[-1] == "INVALID: 1 check failed"


def test_verify_against_a_file_of_the_other_kind_says_so(tmp_path, capsys):
    files = write_reference("xnnpack_ptd", tmp_path / "ref")
    out = tmp_path / "out"
    shutil.copytree(tmp_path / "ref", out)
    code, stdout, _ = _verify(capsys, out / "model.pte", "--against", tmp_path / "ref" / "model.ptd")
    size = os.path.getsize(files["model.ptd"])
    assert (code, stdout) == (1, f"MISMATCH {out / 'model.pte'}: a program (.pte) compared with a data file (.ptd): "
                                 f"they cannot be identical; compare it with {tmp_path / 'ref' / 'model.pte'} "
                                 f"(reference {tmp_path / 'ref' / 'model.ptd'}, {size:,} bytes)\n")
    code, stdout, _ = _verify(capsys, out / "model.ptd", "--against", out / "model.pte")
    assert code == 1 and stdout.startswith(f"MISMATCH {out / 'model.ptd'}: a data file (.ptd) compared with a program "
                                           "(.pte): they cannot be identical; compare it with the reference's .ptd (")


def test_verify_of_an_xnnpack_program_names_the_backend_it_needs(tmp_path, capsys):
    from ptdstream.check.structure import check_structure

    files = write_reference("xnnpack_ptd", tmp_path)
    report = check_structure(files["model.pte"], [files["model.ptd"]])
    assert report.ok and report.needs_backends == ("XnnpackBackend",)
    code, out, _ = _verify(capsys, files["model.pte"], files["model.ptd"])
    assert code == 0
    assert f"ok   {files['model.pte']}: needs backends: XnnpackBackend (registered in executorch.runtime)\n" in out
    plain = write_reference("external", tmp_path / "portable")
    assert check_structure(plain["model.pte"], [plain[EXT_PTD]]).needs_backends == ()
