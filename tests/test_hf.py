"""``ptdstream.hf``: optimum-executorch's two entry points, with ptdstream saving, at a public path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("optimum.exporters.executorch", reason="needs ptdstream[hf] (bash tools/setup.sh --hf)")

pytestmark = pytest.mark.hf


def test_hf_export_and_main_pass_through_to_the_optimum_hooks(monkeypatch):
    """Without ``weightless``, ``ptdstream.hf``'s entry points are the optimum hooks' (arguments unchanged)."""
    import ptdstream
    from ptdstream.hooks import optimum

    assert ptdstream.hf.saving_with_ptdstream is optimum.saving_with_ptdstream
    calls: list = []
    monkeypatch.setattr(optimum, "export", lambda *a, **k: calls.append((a, k)) or {"model": None})
    monkeypatch.setattr(optimum, "main", lambda argv: calls.append(argv) or 0)
    assert ptdstream.hf.export("d", "o", task="t", recipe="portable", max_seq_len=8) == {"model": None}
    assert ptdstream.hf.main(["export", "executorch", "-m", "d"]) == 0
    assert calls == [(("d", "o", "t", "portable"), {"by_reference": True, "max_seq_len": 8}),
                     ["export", "executorch", "-m", "d"]]


def test_python_m_ptdstream_hf_runs_optimum_cli():
    """``python -m ptdstream.hf export executorch --help`` is optimum-cli's own parser."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "ptdstream.hf", "export", "executorch", "--help"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: optimum-cli export executorch")
    assert "--recipe" in proc.stdout


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
    args = ["export", "executorch", "-m", "dir", "--task", "text-generation", "--output_dir", str(tmp_path)]
    assert ptdstream.hf.main(args) == 0
    assert argv == [["optimum-cli", *args]]
    assert capsys.readouterr().err.splitlines()[:2] == [f"saved by ptdstream in {tmp_path}:",
                                                        f"  {tmp_path / 'model.pte'}  10 bytes"]
