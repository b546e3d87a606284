"""``ptdstream.hf``: optimum-executorch's two entry points, with ptdstream saving, at a public path."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
from _procs import SAFETY_S

pytest.importorskip("optimum.exporters.executorch", reason="needs ptdstream[hf] (bash tools/setup.sh --hf)")

pytestmark = pytest.mark.hf


def test_hf_export_and_main_pass_through_to_the_optimum_hooks(monkeypatch, tmp_path):
    """Without ``weightless``, ``ptdstream.hf``'s entry points are the optimum hooks' (arguments unchanged)."""
    import ptdstream
    from ptdstream.hf import saving as optimum

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")

    assert ptdstream.hf.saving_with_ptdstream is optimum.saving_with_ptdstream
    calls: list = []
    monkeypatch.setattr(optimum, "run_main_export", lambda *a, **k: calls.append((a, k)) or {"model": None})
    monkeypatch.setattr(optimum, "run_optimum_cli", lambda argv, **k: calls.append((argv, k)) or 0)
    assert ptdstream.hf.export("d", "o", task="t", recipe="portable", max_seq_len=8) == {"model": None}
    assert ptdstream.hf.main(["export", "executorch", "-m", "d"]) == 0
    assert ptdstream.hf.main(["export", "executorch", "-q", "-m", "d"]) == 0
    assert calls == [(("d", "o", "t", "portable"), {"by_reference": True, "max_seq_len": 8}),
                     (["export", "executorch", "-m", "d"], {"progress": True, "quiet": False}),
                     (["export", "executorch", "-m", "d"], {"progress": False, "quiet": True})]


def test_the_task_defaults_to_optimum_clis_own_default(monkeypatch, tmp_path):
    """``export`` without ``task`` runs the task optimum-cli runs without ``--task``."""
    import argparse
    import inspect

    from optimum.commands.export.executorch import parse_args_executorch

    import ptdstream
    from ptdstream.hf import saving as optimum

    parser = argparse.ArgumentParser()
    parse_args_executorch(parser)
    cli_default = parser.parse_args(["-m", "d", "-o", "o"]).task
    assert cli_default == "text-generation"
    assert inspect.signature(optimum.run_main_export).parameters["task"].default == cli_default
    calls: list = []
    monkeypatch.setattr(optimum, "run_main_export", lambda *a, **k: calls.append(a) or {})
    ptdstream.hf.export("d", "o", recipe="portable")
    assert calls == [("d", "o", cli_default, "portable")]


def test_python_m_ptdstream_hf_runs_optimum_cli():
    """``python -m ptdstream.hf export executorch --help`` is ptdstream's lines, then optimum-cli's own parser."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "ptdstream.hf", "export", "executorch", "--help"],
                          capture_output=True, text=True, env=env, timeout=SAFETY_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import ptdstream.hf.cli

    assert proc.stdout.startswith(ptdstream.hf.cli.HELP + "\nusage: optimum-cli export executorch")
    assert "--recipe" in proc.stdout.removeprefix(ptdstream.hf.cli.HELP)


def _fake_export(out, calls):
    """A stand-in for optimum's export: writes ``model.pte`` and ``model.ptd`` into ``out``
    and raises the noise a real export raises (a FutureWarning, coremltools' import log)."""
    import logging
    import warnings

    def export(model_dir, output_dir=None, **kwargs):
        calls.append((model_dir, output_dir, kwargs))
        warnings.warn("_check_is_size will be removed in a future PyTorch release", FutureWarning, stacklevel=1)
        logging.getLogger("coremltools").warning("Torch version 2.13.0+cpu has not been tested with coremltools")
        with open(os.path.join(out, "model.ptd"), "wb") as f:
            f.write(b"d" * 300)
        with open(os.path.join(out, "model.pte"), "wb") as f:
            f.write(b"p" * 1234)
        return {"model": "manager"}

    return export


def test_export_prints_the_files_it_wrote_and_silences_the_exports_noise(tmp_path, monkeypatch, capsys, caplog):
    import logging
    import warnings

    import optimum.exporters.executorch as optimum_executorch

    import ptdstream.hf

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.ptd").write_bytes(b"untouched")
    calls = []
    monkeypatch.setattr(optimum_executorch, "main_export", _fake_export(str(out), calls))
    caplog.set_level(logging.WARNING)
    level = logging.getLogger("coremltools").level
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        managers = ptdstream.hf.export("model-dir", str(out), task="text-generation", recipe="xnnpack",
                                       use_custom_sdpa=True)
        warnings.warn("after the export", FutureWarning, stacklevel=1)
    assert managers == {"model": "manager"}
    assert calls == [("model-dir", str(out), {"task": "text-generation", "recipe": "xnnpack",
                                              "use_custom_sdpa": True})]
    assert [str(w.message) for w in seen] == ["after the export"]  # silenced only during the call
    assert not [r for r in caplog.records if r.name == "coremltools"]
    assert logging.getLogger("coremltools").level == level
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == [f"saved by ptdstream in {out}:", f"  {out / 'model.pte'}  1,234 bytes",
                         f"  {out / 'model.ptd'}  300 bytes"]
    assert lines[3].startswith("2 files, 1,534 bytes; export and save ") and len(lines) == 4
    ptdstream.hf.export("model-dir", str(out), task="text-generation", quiet=True)
    assert capsys.readouterr().err == ""


def test_hf_main_reports_the_files_in_its_output_dir(tmp_path, monkeypatch, capsys):
    import optimum.commands.optimum_cli as optimum_cli

    import ptdstream.hf

    argv = []

    def cli():
        argv.append(list(sys.argv))
        (tmp_path / "model.pte").write_bytes(b"p" * 10)

    monkeypatch.setattr(optimum_cli, "main", cli)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    args = ["export", "executorch", "-m", "dir", "--task", "text-generation", "--output_dir", str(tmp_path)]
    assert ptdstream.hf.main(args) == 0
    assert argv == [["optimum-cli", *args]]
    lines = capsys.readouterr().err.splitlines()
    report = lines[lines.index(f"saved by ptdstream in {tmp_path}:"):]
    assert report[1] == f"  {tmp_path / 'model.pte'}  10 bytes"
    assert lines[0].endswith("] load dir (from_pretrained and optimum's task set-up) ...")  # the stages first
    assert ptdstream.hf.main([*args, "-q", "-f"]) == 0  # -q: nothing but errors (-f: model.pte is there)
    assert argv[-1] == ["optimum-cli", *args] and capsys.readouterr().err == ""


def test_the_export_prints_its_stages_as_they_run(tmp_path, monkeypatch, capsys):
    """Inside optimum's convert step, with a recipe that does what optimum's do (its
    model's export(), one torch.export per method, to_edge_transform_and_lower,
    to_executorch), each stage is a line as it begins and one with its seconds as it
    ends; the last, the save, ends when the export returns."""
    import re

    import torch
    from executorch.exir import to_edge_transform_and_lower
    from optimum.exporters.executorch import convert, recipe_registry

    from ptdstream.hf.saving import _staged, _stages, saving_with_ptdstream

    class Exportable:
        def export(self):
            lin = torch.nn.Linear(4, 2).eval()
            return {"forward": torch.export.export(lin, (torch.zeros(1, 4),)),
                    "decode": torch.export.export(lin, (torch.zeros(2, 4),))}

    def recipe(model, **kwargs):
        return {"model": to_edge_transform_and_lower(model.export()).to_executorch()}

    monkeypatch.setitem(recipe_registry.recipe_registry, "ptdstream-test", recipe)
    monkeypatch.setattr(recipe_registry, "discover_recipes", lambda: None)
    monkeypatch.setattr(convert, "discover_recipes", lambda: None)
    with saving_with_ptdstream(), _staged(_stages(True), "my-llama"):
        managers = convert.export_to_executorch(Exportable(), "text-generation", "ptdstream-test", str(tmp_path))
    assert list(managers) == ["model"] and (tmp_path / "model.pte").exists()
    lines = [re.sub(r"\d+\.\d s", "S s", line) for line in capsys.readouterr().err.splitlines()]
    assert lines == [
        "[1] load my-llama (from_pretrained and optimum's task set-up) ...",
        "[1] load my-llama (from_pretrained and optimum's task set-up): done in S s (S s in all)",
        "[2] torch.export 1 (Linear) ...", "[2] torch.export 1 (Linear): done in S s (S s in all)",
        "[3] torch.export 2 (Linear) ...", "[3] torch.export 2 (Linear): done in S s (S s in all)",
        "[4] lower and emit programs 'forward', 'decode' (recipe ptdstream-test: to_edge_transform_and_lower, "
        "to_executorch) ...",
        "[4] lower and emit programs 'forward', 'decode' (recipe ptdstream-test: to_edge_transform_and_lower, "
        "to_executorch): done in S s (S s in all)",
        "[5] save model.pte and its .ptd files with ptdstream ...",
        "[5] save model.pte and its .ptd files with ptdstream: done in S s (S s in all)",
    ]
    assert convert.recipe_registry is recipe_registry.recipe_registry  # every hook undone
    assert torch.export.export.__module__ == "torch.export"


def _hf_cli(*argv, cwd):
    """Run ``python -X importtime -m ptdstream.hf ARGV`` in ``cwd``: the process, its CPU
    seconds, the modules it imported."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ptdstream.hf", *argv], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=SAFETY_S)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    modules = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    return proc, cpu, modules, errors


def test_hf_main_refuses_a_bad_model_folder_or_recipe_before_torch_is_imported(tmp_path):
    """-m not a local folder with config.json, --recipe not optimum's: one line naming it, exit 2,
    in well under optimum's import time, torch never imported; nothing written."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "my-llama").mkdir()
    (tmp_path / "my-llama" / "config.json").write_text("{}")
    head = ["export", "executorch", "--task", "text-generation", "-o", "out"]
    cases = [
        ([*head, "-m", "nope/"], "ptdstream.hf: error: -m nope/: no such folder; give a local model folder "
         "(config.json and safetensors, as save_pretrained writes them): nothing is downloaded"),
        ([*head, "--model=empty", "--weightless"], "ptdstream.hf: error: -m empty: no config.json in that folder; "
         "give the folder save_pretrained wrote (config.json and safetensors)"),
        ([*head, "-m", "my-llama", "--recipe", "xnnpak"], "ptdstream.hf: error: --recipe xnnpak: not an "
         "optimum-executorch recipe; use one of coreml_fp16, coreml_fp16_cpu, coreml_fp16_gpu, coreml_fp16_ne, "
         "coreml_fp32, coreml_fp32_cpu, coreml_fp32_gpu, coreml_fp32_ne, cuda, cuda-windows, metal, portable, "
         "xnnpack"),
        (head, "ptdstream.hf: error: -m/--model DIR is required: the local Hugging Face model folder "
         "(with config.json) to export"),
        ([*head, "-m", "my-llama", "--max_seq_len", "abc"], "ptdstream.hf: error: --max_seq_len abc: not a "
         "positive integer (e.g. --max_seq_len 2048)"),
        ([*head, "-m", "my-llama", "--qlinear_group_size=0"], "ptdstream.hf: error: --qlinear_group_size 0: not a "
         "positive integer (e.g. --qlinear_group_size 32)"),
    ]
    for argv, message in cases:
        proc, cpu, modules, errors = _hf_cli(*argv, cwd=tmp_path)
        assert (proc.returncode, proc.stdout, errors) == (2, "", [message]), argv
        assert cpu < 1.5, (argv, cpu)
        assert "torch" not in modules and "optimum" not in modules, argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "my-llama"]


def test_hf_main_weightless_refuses_an_uncovered_quantization_before_torch_and_passes_covered_ones(tmp_path):
    """--weightless --qlinear fpa4w: one line, exit 1, torch never imported; --qlinear 8da4w --qembedding 8w
    passes the check (it goes on to optimum, which then refuses the empty config.json)."""
    (tmp_path / "my-llama").mkdir()
    (tmp_path / "my-llama" / "config.json").write_text("{}")
    head = ["export", "executorch", "--task", "text-generation", "-o", "out", "-m", "my-llama", "--weightless"]
    proc, cpu, modules, errors = _hf_cli(*head, "--qlinear", "fpa4w", "--qembedding", "8w", cwd=tmp_path)
    assert (proc.returncode, proc.stdout, errors) == (1, "", [
        "ptdstream.hf: error: my-llama: --qlinear 'fpa4w': --weightless quantizes each weight as it is read only "
        "with qlinear 8da4w, 8da8w, 4w, 8w; qlinear_encoder 8da4w, 8da8w, 4w, 8w; qembedding 8w, 4w; "
        "qembedding_encoder 8w, 4w; use one of them, or export without --weightless"])
    assert cpu < 1.5 and "torch" not in modules and "optimum" not in modules
    from ptdstream.hf.routes import quantization_refusal

    covered = {"qlinear": "8da4w,8da8w", "qembedding": "8w", "qlinear_packing_format": "tile_packed_to_4d"}
    assert quantization_refusal("m", covered, "--{} {!r}", "--weightless", "x") is None
    (tmp_path / "my-llama" / "pytorch_model.bin").write_bytes(b"not read")
    proc, cpu, modules, errors = _hf_cli(*head, "--qlinear", "8da4w", cwd=tmp_path)
    assert (proc.returncode, proc.stdout, errors) == (1, "", [
        "ptdstream.hf: error: my-llama: --weightless reads safetensors shards and the folder has none; it holds "
        "pytorch_model.bin (pickles, not read): save the model with save_pretrained(safe_serialization=True), or "
        "export without --weightless"])
    assert cpu < 1.5 and "torch" not in modules and "optimum" not in modules
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-llama"]


def test_hf_export_weightless_refuses_a_folder_without_safetensors_before_optimum_runs(tmp_path):
    import ptdstream.hf
    from ptdstream.weightless import NeedsWeightValuesError

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(NeedsWeightValuesError) as caught:
        ptdstream.hf.export(str(tmp_path / "m"), str(tmp_path / "out"), weightless=True)
    assert str(caught.value) == (f"{tmp_path / 'm'}: weightless=True reads safetensors shards and the folder has "
                                 "none; it holds no weights file: save the model with "
                                 "save_pretrained(safe_serialization=True), or export with weightless=False")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_hf_recipe_names_are_optimums():
    """The static list main checks --recipe against is optimum-executorch's registry."""
    from optimum.exporters.executorch.recipe_registry import discover_recipes, recipe_registry

    from ptdstream.hf.cli import OPTIMUM_RECIPES

    discover_recipes()
    assert sorted(recipe_registry) == list(OPTIMUM_RECIPES)


def test_hf_help_names_weightless_before_optimums_help(monkeypatch, capsys):
    """--help prints ptdstream's options (--weightless, the -m and --recipe checks) first,
    then optimum-cli's help."""
    import optimum.commands.optimum_cli as optimum_cli

    import ptdstream.hf.cli

    monkeypatch.setattr(optimum_cli, "main", lambda: print("usage: optimum-cli export executorch"))
    assert ptdstream.hf.main(["export", "executorch", "--help"]) == 0
    out = capsys.readouterr().out
    assert out == ptdstream.hf.cli.HELP + "\nusage: optimum-cli export executorch\n"
    flat = " ".join(out.split())
    assert "--weightless build the model from DIR/config.json with no weight loaded" in flat
    assert "--recipe RECIPE one of coreml_fp16, " in flat and "portable, xnnpack" in flat


def test_hf_help_without_a_command_imports_neither_optimum_nor_torch():
    """Bare ``--help``: ptdstream's lines and how to get the export's own options,
    without importing optimum (whose top-level help lists only its command names)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = ("import sys, ptdstream.hf\nrc = ptdstream.hf.main(['--help'])\n"
            "print(rc, sorted(m for m in ('torch', 'optimum', 'executorch') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=SAFETY_S)
    import ptdstream.hf.cli

    head = ptdstream.hf.cli.HELP.removesuffix("optimum-cli's own help follows.\n")
    assert head.endswith("optimum's integer options: positive integers\n\n")
    assert proc.stdout == head + ptdstream.hf.cli.HELP_WITHOUT_COMMAND.lstrip("\n") + "0 []\n", proc.stdout
    assert "python -m ptdstream.hf export executorch --help" in proc.stdout
