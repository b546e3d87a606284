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
