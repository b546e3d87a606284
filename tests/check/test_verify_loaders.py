"""Verify answers for the loader the user has: executorch.runtime's ``load_program``
takes one data file, so a program whose weights upstream split over two ``.ptd``
files does not load there (with either file, or none), and verify says so, naming the
keys each file lacks (exit 1); the C++ ``Module`` given several data files loads it
(``--loader module``: exit 0, with a line saying it needs such a loader)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _procs import SAFETY_S
from conftest import Mlp, reference_files

from ptdstream.check.structure import check_structure
from ptdstream.save import write_data_files
from ptdstream.store import StreamingNamedDataStore


def _split_program(kind: str, folder) -> tuple[str, str, str]:
    """``Mlp`` exported by upstream with l1's weights in ``first.ptd`` and l2's in
    ``second.ptd``: portable (``external_constants`` naming the file per node) or XNNPACK
    (``delegate_external_constants_pass_unlifted``); ``(model.pte, first.ptd, second.ptd)``."""
    from executorch.exir import ExecutorchBackendConfig, to_edge, to_edge_transform_and_lower

    def tag(node) -> str:
        return "first" if "l1" in str(node.target) or node.name.startswith("p_l1") else "second"

    torch.manual_seed(0)
    example = (torch.randn(2, 64),)
    if kind == "portable":
        edge = to_edge(torch.export.export(Mlp().eval(), example, strict=True))
        manager = edge.to_executorch(ExecutorchBackendConfig(external_constants=tag))
    else:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

        unlifted = torch.export.export(Mlp().eval(), example, strict=False).module()
        delegate_external_constants_pass_unlifted(unlifted, gen_tag_fn=tag)
        edge = to_edge_transform_and_lower(torch.export.export(unlifted, example, strict=False),
                                           partitioner=[XnnpackPartitioner()])
        manager = edge.to_executorch(ExecutorchBackendConfig())
    files = reference_files(manager, str(folder))
    assert sorted(files) == ["first.ptd", "model.pte", "second.ptd"]
    return tuple(os.path.join(str(folder), n) for n in ("model.pte", "first.ptd", "second.ptd"))


def _runtime(jobs: list[tuple[str, str | None]]) -> list[tuple[str, str]]:
    """executorch.runtime's verdicts on ``(pte, data_path)`` jobs, in a child that survives
    its crashes (``_runtime_judge.py``: XNNPACK's init crashes on a key it cannot find)."""
    judge = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_runtime_judge.py")
    proc = subprocess.run([sys.executable, judge, str(1 << 30)], input="".join(json.dumps(j) + "\n" for j in jobs),
                          capture_output=True, text=True, timeout=SAFETY_S)
    out = [tuple(json.loads(line)) for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(out) == len(jobs), proc.stderr[-2000:]
    return out


#: The keys of each file, as verify names them (portable: the FQNs; XNNPACK: content hashes).
def _keys(ptd: str) -> list[str]:
    from ptdstream.format.reader import read_artifact

    return [e.key for e in read_artifact(ptd).named]


@pytest.mark.parametrize("kind", ["portable", "xnnpack"])
def test_a_program_split_over_two_ptd_files_fails_for_the_runtime_and_passes_for_module(tmp_path, capsys, kind):
    from ptdstream.cli import main

    pte, first, second = _split_program(kind, tmp_path)
    verdicts = _runtime([(pte, None), (pte, first), (pte, second)])  # executorch.runtime: one data file
    # XNNPACK's init crashes the runtime (SIGSEGV) with no data file at all
    assert [v for v, _ in verdicts] == ["refused" if kind == "portable" else "crash", "refused", "refused"], verdicts
    assert verdicts[1][1] == verdicts[2][1] == "RuntimeError: Failed to load method forward, error: 0x:20"
    in_first, in_second = _keys(first), _keys(second)
    assert len(in_first) == len(in_second) == 2 and not set(in_first) & set(in_second)

    report = check_structure(pte, [first, second])
    assert not report.ok and report.loader == "runtime"
    assert [(c.name, c.detail) for c in report.problems] == [(
        "loader",
        "executorch.runtime (load_program, one data file): the methods need keys from 2 .ptd files, load_program "
        f"takes one data_path: with {first} alone, {in_second[0]!r}, {in_second[1]!r} missing; with {second} alone, "
        f"{in_first[0]!r}, {in_first[1]!r} missing (load_method fails with any one of them); a loader taking several "
        "data files loads it (C++ Module with data_files: verify --loader module)")]
    assert main(["verify", pte, first, second, "-q"]) == 1
    _, err = capsys.readouterr()
    assert err.splitlines()[-1] == f"ptdstream verify: INVALID {pte}: loader: {report.problems[0].detail}"

    report = check_structure(pte, [first, second], loader="module")
    assert report.ok and report.loader == "module", report.summary()
    assert main(["verify", pte, first, second, "--loader", "module"]) == 0
    out, _ = capsys.readouterr()
    assert (f"ok   {pte}: loader: C++ Module (several data files, merged): needs a loader taking several data files: "
            f"{first}, {second} (executorch.runtime's load_program takes one)\n") in out
    assert out.endswith("OK: structure valid\n")


def test_a_program_with_one_data_file_passes_for_both_loaders_naming_it(tmp_path, capsys):
    from executorch.exir import ExecutorchBackendConfig, to_edge

    from ptdstream.cli import main

    torch.manual_seed(0)
    edge = to_edge(torch.export.export(Mlp().eval(), (torch.randn(2, 64),), strict=True))
    reference_files(edge.to_executorch(ExecutorchBackendConfig(external_constants=True)), str(tmp_path))
    pte, ptd = str(tmp_path / "model.pte"), str(tmp_path / "_default_external_constant.ptd")
    store = StreamingNamedDataStore()
    store.add_named_data("other", torch.ones(4), alignment=16, external_tag="spare")
    write_data_files(store, str(tmp_path))
    spare = str(tmp_path / "spare.ptd")  # a key the program does not need
    assert _runtime([(pte, ptd)]) == [("ok", "")]
    for loader, name in (("runtime", "executorch.runtime (load_program, one data file)"),
                         ("module", "C++ Module (several data files, merged)")):
        assert main(["verify", pte, ptd, spare, "--loader", loader, "--json"]) == 0
        out, _ = capsys.readouterr()
        report = json.loads(out)
        assert report["loader"] == loader and report["ok"] is True
        assert [c["detail"] for c in report["checks"] if c["name"] == "loader"] == [
            f"{name}: data file {ptd}; not needed: {spare}"]


def test_verify_of_one_of_the_two_files_names_the_command_with_both_and_the_loader(tmp_path, capsys):
    pte, first, second = _split_program("portable", tmp_path)
    report = check_structure(pte, [first])
    assert [c.detail for c in report.problems] == [
        f"missing from the given .ptd files: 'l2.weight', 'l2.bias'; {second} beside it holds them: ptdstream verify "
        f"{pte} {first} {second} --loader module (the keys are in several .ptd files: executorch.runtime's "
        "load_program takes one)"]
    assert check_structure(pte, [first], loader="module").problems[0].detail.endswith(
        f"beside it holds them: ptdstream verify {pte} {first} {second}")
    with pytest.raises(ValueError, match="loader 'c': expected one of runtime, module"):
        check_structure(pte, [first], loader="c")
