"""Messages that say what to do next: a checkpoint of another model (or under other
names) for ``weights``, a shape a key map cannot fix, a program verified without the
``.ptd`` beside it, files of the wrong kind for verify, a manifest's first bad piece."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from _models_rv import model, write_reference
from safetensors.torch import save_file

from ptdstream import CheckpointMismatchError, write_ptd
from ptdstream.weightless import BindingError
from ptdstream.weights.write import read_program_weights

EXT_PTD = "_default_external_constant.ptd"


@pytest.fixture(scope="module")
def external(tmp_path_factory):
    """The external-constants program (TwoLinear: a.weight, a.bias, b.weight, b.bias) and its state."""
    files = write_reference("external", tmp_path_factory.mktemp("external"))
    state = {k: v.detach().contiguous() for k, v in model("external").state_dict().items()}
    return files["model.pte"], state


def _problems(tmp_path, program, state) -> list[str]:
    ckpt = str(tmp_path / "ck.safetensors")
    save_file(state, ckpt)
    with pytest.raises(CheckpointMismatchError) as info:
        write_ptd(program, ckpt, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["ck.safetensors"]  # nothing written
    return info.value.problems


def test_a_checkpoint_under_another_prefix_gets_the_one_map_that_finds_every_key(external, tmp_path):
    program, state = external
    problems = _problems(tmp_path, program, {"model." + k: v for k, v in state.items()})
    ckpt = tmp_path / "ck.safetensors"
    assert problems[0] == (f"none of the program's 4 keys is in {ckpt}, but each is there under another prefix: "
                           "key_map={'': 'model.'} / --map =model.")
    assert not any("a tied weight saved under its other name" in p for p in problems)
    os.makedirs(tmp_path / "out")
    assert write_ptd(program, str(ckpt), str(tmp_path / "out"), key_map={"": "model."}).keys == 4  # the map works


@pytest.mark.parametrize("names,keys,found", [
    (["model.layers.0.w", "model.norm.w"], ["layers.0.w", "norm.w", "extra"], ("model.", "")),
    (["transformer.h.0.w", "transformer.ln.w"], ["model.h.0.w", "model.ln.w"], ("transformer.", "model.")),
    (["0.weight", "1.bias"], ["other.0.weight", "other.1.bias"], ("", "other.")),
    (["a.w", "b.w"], ["x.a.w", "y.b.w"], None),  # no single prefix finds both
])
def test_the_prefix_map_is_one_rewrite_that_finds_every_name(names, keys, found):
    from ptdstream.weights.check import _prefix_map

    assert _prefix_map(names, set(keys)) == found


def test_a_checkpoint_of_another_model_says_so_first(external, tmp_path):
    """Not ``--map 'a.bias'=...`` for each of five norms of the same shape: the first
    line says that no key is there, with the first names of both."""
    program, _ = external
    keys = list(read_program_weights(program).keys)
    other = {f"norm{i}.weight": torch.zeros(3) for i in range(5)}
    problems = _problems(tmp_path, program, other)
    ckpt = tmp_path / "ck.safetensors"
    assert problems[0] == (f"none of the program's 4 keys is in {ckpt}: a checkpoint of another model? (the "
                           f"program's keys: {keys[0]!r}, {keys[1]!r}, {keys[2]!r}, ...; the checkpoint's: "
                           "'norm0.weight', 'norm1.weight', 'norm2.weight', ...)")
    assert [p.split(" (")[0] for p in problems[1:5]] == [f"missing: {k!r}" for k in keys]
    assert not any("--map" in p for p in problems[1:5])


def test_one_key_missing_still_gets_its_twin(external, tmp_path):
    """When other keys were found, a missing key's unused twin (same dtype and shape)
    is still named: the tied-weight hint stays."""
    program, state = external
    renamed = dict(state)
    renamed["tied.bias"] = renamed.pop("b.bias")
    problems = _problems(tmp_path, program, renamed)
    assert len(problems) == 2 and problems[0].endswith(
        "its checkpoint key 'tied.bias' has its dtype and shape (a tied weight saved under its other name?): "
        "key_map={'b.bias': 'tied.bias'} / --map b.bias=tied.bias")


def test_a_binding_error_advises_a_key_map_only_for_names():
    """A map fixes names (missing, extra), never a dtype or a shape."""
    shape = "shape: 'l1.bias' <- key 'l1.bias' (ck.safetensors): the checkpoint holds [31], the export needs [32]"
    missing = "missing: 'l2.bias' needs checkpoint key 'l2.bias', which the checkpoint does not hold"
    only_shape = str(BindingError("ck.safetensors", [shape]))
    assert only_shape.endswith(f"\n  {shape}\nfix the checkpoint: it holds these weights in other dtypes or shapes "
                               "than the model (a checkpoint of another configuration?); a key_map cannot change a "
                               "dtype or a shape")
    assert "key_map={fqn" not in only_shape
    assert str(BindingError("ck.safetensors", [shape, missing])).endswith(
        "\nfix the checkpoint, or map names with key_map={fqn: checkpoint key}")


def test_a_shape_mismatch_through_weights_from_gives_no_key_map_advice(tmp_path):
    from conftest import Mlp, example_inputs

    from ptdstream import weights_from

    torch.manual_seed(0)
    state = {k: v.detach().contiguous() for k, v in Mlp().state_dict().items()}
    state["l1.bias"] = torch.zeros(31)
    save_file(state, str(tmp_path / "ck.safetensors"))
    with weights_from(str(tmp_path / "ck.safetensors")) as weights:
        program = torch.export.export(weights.model(Mlp), example_inputs(Mlp()))
        with pytest.raises(BindingError) as caught:
            weights.bind(program)
    assert str(caught.value).endswith("a key_map cannot change a dtype or a shape")


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


def test_a_manifest_names_the_differing_bytes_first_and_the_piece_as_a_piece(tmp_path, capsys):
    from ptdstream.cli import main

    files = write_reference("external", tmp_path)
    ptd = files[EXT_PTD]
    assert main(["manifest", ptd, "-o", str(tmp_path / "m.manifest"), "--piece-size", "4096", "-q"]) == 0
    size = os.path.getsize(ptd)
    with open(ptd, "r+b") as f:
        f.seek(size - 1)
        last = f.read(1)
        f.seek(size - 1)
        f.write(bytes([last[0] ^ 1]))
    code, out, _ = _verify(capsys, ptd, "--manifest", tmp_path / "m.manifest")
    piece = (size - 1) // 4096
    assert code == 1 and out.startswith(f"BAD {ptd}: differs in bytes [")
    assert f" (first bad piece {piece}, bytes [{piece * 4096:,}, {size:,})); section " in out


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
