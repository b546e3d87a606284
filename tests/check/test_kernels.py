"""verify knows every kernel library shipped with executorch (ptdstream.check.runtime.kernels): the
committed registry is what the runtime gains when each library is loaded, a program that
calls a library's operators loads in the runtime only with that library, and verify
accepts it by default, names the library it needs, and refuses it under a --kernels
without that library or when no shipped library has the operator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _procs import SAFETY_S

from ptdstream.check.runtime.kernels import TITLES
from ptdstream.check.runtime.registry import EXECUTORCH_VERSION, KERNEL_MODULES, KERNEL_OPERATORS
from ptdstream.check.structure import check_structure
from ptdstream.cli import main
from ptdstream.errors import LayoutError

pytestmark = pytest.mark.slow

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_kernel_programs.py")


def _helper(*args: str) -> object:
    proc = subprocess.run([sys.executable, HELPER, *args], capture_output=True, text=True, timeout=SAFETY_S)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    return _helper("both", str(tmp_path_factory.mktemp("kernels")))


@pytest.fixture(scope="module")
def programs(judged):
    """{library: .pte calling its operators}, plus "unknown": the llm program with its
    operator renamed to one no library has."""
    return judged["programs"]


@pytest.fixture(scope="module")
def stages(judged):
    return judged["stages"]


def test_each_library_is_what_the_runtime_registers_when_it_is_loaded(stages):
    base = set(stages[0]["operators"])
    assert base == KERNEL_OPERATORS["portable"] | KERNEL_OPERATORS["optimized"]
    assert {"aten::add.out", "executorch_prim::add.Scalar"} <= KERNEL_OPERATORS["portable"]
    assert "aten::_fft_r2c.out" in KERNEL_OPERATORS["optimized"]
    loaded = [lib for lib, module in KERNEL_MODULES.items() if module]
    assert [s["loaded"] for s in stages[1:]] == [KERNEL_MODULES[lib] for lib in loaded] and loaded == ["quantized",
                                                                                                       "llm"]
    for before, after, lib in zip(stages[:-1], stages[1:], loaded, strict=True):
        assert set(after["operators"]) - set(before["operators"]) == KERNEL_OPERATORS[lib]
    assert {"llama::update_cache.out", "llama::custom_sdpa.out"} <= KERNEL_OPERATORS["llm"]
    assert "quantized_decomposed::quantize_per_tensor.out" in KERNEL_OPERATORS["quantized"]


def test_the_runtime_loads_each_program_only_once_its_library_is_loaded(programs, stages):
    def verdicts(stage):
        return {lib: stage["verdicts"][path] == "ok" for lib, path in programs.items()}

    assert verdicts(stages[0]) == {"portable": True, "optimized": True, "quantized": False, "llm": False,
                                   "unknown": False}
    assert verdicts(stages[1]) == {"portable": True, "optimized": True, "quantized": True, "llm": False,
                                   "unknown": False}
    assert verdicts(stages[2]) == {"portable": True, "optimized": True, "quantized": True, "llm": True,
                                   "unknown": False}


@pytest.mark.parametrize("lib, needs", [("portable", ("portable",)), ("optimized", ("portable", "optimized")),
                                        ("quantized", ("quantized",)), ("llm", ("llm",))])
def test_verify_accepts_a_program_of_each_library_and_names_what_it_needs(programs, lib, needs):
    report = check_structure(programs[lib])
    assert report.ok and report.needs_kernels == needs and json.loads(report.to_json())["needs_kernels"] == list(needs)
    line = f"ok   {programs[lib]}: needs kernels: {', '.join(TITLES[n] for n in needs)}"
    module = KERNEL_MODULES[lib]
    if module:
        line += f" (in Python: import {module} before loading the program)"
    assert line in report.summary().splitlines()


def test_kernels_restricts_verify_and_the_refusal_names_operator_and_library(programs, capsys):
    report = check_structure(programs["llm"], kernels="portable,optimized")
    assert not report.ok and report.needs_kernels == ()
    assert ("operator 'llama::custom_sdpa.out' is not registered: it is in the llm custom ops kernel library "
            "(llm), not among the libraries checked; add llm to --kernels") in report.problems[0].detail
    assert check_structure(programs["llm"], kernels=["llm"]).ok
    assert main(["verify", programs["quantized"], "--kernels", "portable,llm"]) == 1
    out = capsys.readouterr().out
    assert "operator 'quantized_decomposed::quantize_per_tensor.out' is not registered: it is in the quantized " \
           "kernel library (quantized)" in out and out.endswith("INVALID: 1 check failed\n")
    assert main(["verify", programs["quantized"], "--kernels", "quantized"]) == 0


def test_an_operator_no_shipped_library_has_stays_refused(programs, capsys):
    report = check_structure(programs["unknown"])
    assert not report.ok
    assert (f"operator 'llama::custom_sdpz.out' is not registered: no kernel library shipped with executorch "
            f"{EXECUTORCH_VERSION} has it (portable, optimized, quantized, llm)") in report.problems[0].detail
    assert main(["verify", programs["unknown"]]) == 1
    assert "llama::custom_sdpz.out" in capsys.readouterr().out


def test_an_unknown_kernel_library_is_a_usage_error(programs, capsys):
    with pytest.raises(LayoutError, match=r"kernel libraries 'cuda': executorch 1\.5\.1 ships portable, optimized, "
                                          r"quantized, llm"):
        check_structure(programs["portable"], kernels="portable,cuda")
    assert main(["verify", programs["portable"], "--kernels", "portable,cuda"]) == 2
    err = capsys.readouterr().err
    assert "ptdstream verify: argument --kernels: kernel libraries 'cuda': executorch 1.5.1 ships" in err
