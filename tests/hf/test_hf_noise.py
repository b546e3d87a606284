"""``python -m ptdstream.hf`` silences the pinned stack's known, harmless lines (and only
those, and only in its own process): torchao's failed CUDA kernel loads, torch's
pytree Enum warning, the LeafSpec FutureWarning, transformers' ``torch_dtype``
deprecation, and its ``Loading weights`` bar in a log."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _procs import SAFETY_S

from ptdstream.hf import noise

pytest.importorskip("transformers", reason="needs ptdstream[hf] (bash tools/setup.sh --hf)")

pytestmark = pytest.mark.hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SITE = os.path.dirname(os.path.dirname(pytest.__file__))  # the installed packages

EMIT = r'''
import logging, sys, warnings
warnings.simplefilter("default")
logging.basicConfig(format="%(name)s: %(message)s", stream=sys.stderr)
if sys.argv[1] == "silenced":
    from ptdstream.hf.noise import silence_known_noise
    silence_known_noise()
logging.getLogger("torchao").warning("Failed to load /v/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu"
                                     ".so: Could not load this library")
logging.getLogger("torchao").warning("Failed to load my_plugin")  # not torchao's kernel library: kept
logging.getLogger("torch.utils._pytree").warning(
    "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an opaque value "
    "type. Calling register_constant() on Enum subclasses is deprecated")
logging.getLogger("transformers.configuration_utils").warning("`torch_dtype` is deprecated! Use `dtype` instead!")
logging.getLogger("transformers.modeling_utils").warning("`torch_dtype` is deprecated! Use `dtype` instead!")  # kept
warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
              "treespec.is_leaf()` instead.", FutureWarning)
warnings.warn("the user's own FutureWarning", FutureWarning)  # kept
import os
print("bars off" if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == "1" else "bars on", file=sys.stderr)
'''


def _emit(how: str, **env) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", EMIT, how], capture_output=True, text=True, timeout=SAFETY_S,
                          env=dict(os.environ, PYTHONPATH=ROOT, **env))
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stderr.splitlines() if not line.startswith("  warnings.warn")]


def test_only_the_known_lines_are_silenced(monkeypatch):
    monkeypatch.delenv("PTDSTREAM_DEBUG", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    loud = _emit("loud")
    assert len(loud) == 8 and loud[-1] == "bars on"
    quiet = _emit("silenced")
    assert quiet[0] == "torchao: Failed to load my_plugin"
    assert quiet[1] == "transformers.modeling_utils: `torch_dtype` is deprecated! Use `dtype` instead!"
    assert quiet[2].endswith("FutureWarning: the user's own FutureWarning")
    assert quiet[3:] == ["bars off"]  # stderr is a pipe here: transformers' bar would be a 6 KB line
    assert len(_emit("silenced", PTDSTREAM_DEBUG="1")) == 8  # the debug switch keeps everything


def test_the_patterns_are_the_pinned_stacks_own_text():
    """Each pattern names text the installed torchao, torch and transformers print: a
    release that changes it fails here instead of printing it again unnoticed."""
    sources = {
        "torchao": os.path.join(SITE, "torchao", "__init__.py"),
        "torch.utils._pytree": os.path.join(SITE, "torch", "utils", "_pytree.py"),
        "transformers.configuration_utils": os.path.join(SITE, "transformers", "configuration_utils.py"),
    }
    texts = {name: open(path).read() for name, path in sources.items()}
    assert 'logger.warning(f"Failed to load {file}: {e}")' in texts["torchao"] and '"_C*.so"' in texts["torchao"]
    assert ('"%s is an Enum subclass and is now natively supported by "\n                "torch.compile as an opaque'
            in texts["torch.utils._pytree"])
    assert "`torch_dtype` is deprecated! Use `dtype` instead!" in texts["transformers.configuration_utils"]
    assert "`isinstance(treespec, LeafSpec)` is deprecated" in texts["torch.utils._pytree"]
    assert [name for name, _ in noise.KNOWN_RECORDS] == list(sources)


def test_importing_torchao_prints_none_of_it_when_silenced():
    """The real imports: torchao's failed kernel loads and torch's Enum warnings on a CPU
    machine, gone after silence_known_noise()."""
    code = ("import sys\nif sys.argv[1] == 'silenced':\n    from ptdstream.hf.noise import silence_known_noise\n"
            "    silence_known_noise()\nimport torchao\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("PTDSTREAM_DEBUG", None)
    loud = subprocess.run([sys.executable, "-c", code, "loud"], capture_output=True, text=True, env=env,
                          timeout=SAFETY_S)
    if "Failed to load" not in loud.stderr and "Enum subclass" not in loud.stderr:
        pytest.skip("torchao imports without noise here (its CUDA kernels load)")
    quiet = subprocess.run([sys.executable, "-c", code, "silenced"], capture_output=True, text=True, env=env,
                           timeout=SAFETY_S)
    assert quiet.returncode == 0
    assert "Failed to load" not in quiet.stderr and "Enum subclass" not in quiet.stderr, quiet.stderr


def test_only_the_command_lines_process_drops_them(capsys):
    """``python -m ptdstream.hf`` (its ``__main__``) installs the filters; the library,
    ``ptdstream.hf.main()`` called from a user's code included, leaves the user's
    filters alone."""
    import logging

    import ptdstream.hf

    assert ptdstream.hf.main(["--help"]) == 0
    capsys.readouterr()
    for name, _ in noise.KNOWN_RECORDS:
        assert not any(isinstance(f, noise._Drop) for f in logging.getLogger(name).filters), name
    code = ("import logging, runpy, sys\nsys.argv = ['ptdstream.hf', '--help']\ntry:\n"
            "    runpy.run_module('ptdstream.hf', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "from ptdstream.hf.noise import KNOWN_RECORDS, _Drop\n"
            "print([sum(isinstance(f, _Drop) for f in logging.getLogger(n).filters) for n, _ in KNOWN_RECORDS])")
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("PTDSTREAM_DEBUG", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=SAFETY_S)
    assert proc.stdout.splitlines()[-1] == "[1, 1, 1]", proc.stdout + proc.stderr
