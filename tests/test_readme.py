"""README.md and every docs/*.md run: every Python and shell block, against the demo's model.

A module fixture builds the demo (``ptdstream.demo``: export, XNNPACK lowering),
saves it into ``out/`` with ptdstream and into ``ref/`` with executorch's own
writer, in a temp folder that every block then runs in. Python blocks run in
the session docs/examples.md tells a user to start: the namespace its names
block leaves (``make_edge``, ``config``, ``weight_tensor``, ``state_dict``, an
``edge`` already lowered once, ...), nothing else, so a block that uses a name
the docs do not make, or lowers an edge program manager twice, fails; shell
blocks run with bash, ``ptdstream`` being this interpreter's command. A new file under docs/ is covered as it lands;
the files run in order (README.md first), each block in the order it appears,
and each file starts from the folder and namespace as the fixture made them (what
one file's blocks write never reaches another's).
Blocks that set up a machine (``tools/setup.sh``,
the test suite itself) and blocks that need a GPU are left out, by rule, below.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import SAFETY_S

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def doc_files() -> list[Path]:
    """README.md, then every Markdown file under docs/ (sorted)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def doc_blocks(path: Path) -> list[tuple[int, str, str]]:
    """``(line, language, code)`` of each fenced ``python``/``sh`` block of ``path``,
    indented ones (inside a list item) included, their indentation removed."""
    text = path.read_text()
    blocks = []
    for m in re.finditer(r"^( *)```(\w+)\n(.*?)^\1```", text, re.S | re.M):
        if m.group(2) in ("python", "sh"):
            indent = len(m.group(1))
            code = "".join(line[indent:] if line[:indent].isspace() else line
                           for line in m.group(3).splitlines(keepends=True))
            blocks.append((text.count("\n", 0, m.start()) + 1, m.group(2), code))
    return blocks


def _skip_reason(language: str, code: str) -> str:
    if "tools/setup.sh" in code and "pytest" in code:
        return "the test suite itself"
    if "stream_cuda_weights" in code:
        import torch

        if not torch.cuda.is_available():
            return "needs a CUDA device"
    if "ptdstream.hf" in code and not _hf_installed():
        return "needs the hf extra (tools/setup.sh --hf)"
    if "pip install" in code:
        return "installs packages"
    return ""


def _hf_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("transformers") is not None


BLOCKS = [(f"{path.relative_to(ROOT)}:{line}", language, code)
          for path in doc_files() for line, language, code in doc_blocks(path)]


def names_block() -> str:
    """docs/examples.md's Python block that makes the examples' names (the one
    defining ``make_edge``): the start of the docs' session."""
    blocks = [code for _, language, code in doc_blocks(ROOT / "docs" / "examples.md")
              if language == "python" and "def make_edge" in code]
    assert len(blocks) == 1, "docs/examples.md: expected one Python block defining make_edge"
    return blocks[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder holding the demo saved by ptdstream (out/) and by executorch (ref/),
    a tiny Hugging Face Llama (my-llama/, with the hf extra), and what
    docs/examples.md's names block makes there (engine.bin, model.pte,
    finetuned.safetensors); plus the namespace that block leaves, which Python
    blocks run in (a one-rank gloo group for the distributed block)."""
    import torch
    import torch.distributed as dist

    import ptdstream
    from ptdstream.demo import run as demo
    from ptdstream.demo.model import build_tiny_lm

    root = tmp_path_factory.mktemp("readme")
    model = build_tiny_lm()
    programs = demo.export_programs(model)
    edge = demo.lower(programs)
    config = demo.backend_config()
    manager = edge.to_executorch(config)
    for folder in ("out", "ref"):
        (root / folder).mkdir()
    ptdstream.save(manager, str(root / "out" / "model.pte"))
    with open(root / "ref" / "model.pte", "wb") as f:
        manager.write_to_file(f)
    manager.write_tensor_data_to_file(str(root / "ref"))
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(root)
    try:
        exec(compile(names_block(), "docs/examples.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    if _hf_installed():
        import transformers

        llama = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, tie_word_embeddings=False)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(llama).save_pretrained(str(root / "my-llama"))
    # an in-memory store: a free port probed then bound could be taken by another process in between
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pristine = tmp_path_factory.mktemp("readme-pristine")
    shutil.copytree(root, pristine, dirs_exist_ok=True, symlinks=True)
    yield root, namespace, pristine
    dist.destroy_process_group()


def _shell(code: str) -> str:
    """The block as a bash script: setup runs become runs of this install's command."""
    lines = []
    for line in code.splitlines():
        line = re.sub(r"^bash tools/setup.sh( --\w+)* && ", "", line)
        line = line.replace(".venv/bin/", "")
        lines.append(line)
    return "\n".join(lines)


_current: dict[str, object] = {}


def _state_of(doc: str, root: Path, base: dict, pristine: Path) -> dict:
    """The namespace for a block of ``doc``; at a file's first block, ``root`` is
    made again from ``pristine`` and the namespace again from ``base``."""
    if _current.get("doc") != doc:
        for entry in root.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        shutil.copytree(pristine, root, dirs_exist_ok=True, symlinks=True)
        _current.update(doc=doc, namespace=dict(base))
    return _current["namespace"]  # type: ignore[return-value]  # set just above


def test_docs_blocks_found():
    """Every docs file's blocks are collected: the README's first block is the demo
    command, and a block indented in a list item is found with its indentation removed."""
    assert BLOCKS[0][0].startswith("README.md:") and BLOCKS[0][2] == "bash tools/setup.sh && .venv/bin/ptdstream demo\n"
    sources = {where.split(":")[0] for where, _, _ in BLOCKS}
    assert {"README.md", "docs/api.md", "docs/weights.md", "docs/troubleshooting.md"} <= sources
    indented = [code for where, _, code in BLOCKS if where.startswith("docs/troubleshooting.md:")]
    assert "ptdstream recover out/\n" in indented[0]


def test_docs_session_edge_lowered_once(workdir):
    """The session is the one docs/examples.md leaves: its ``edge`` has been lowered,
    and lowering it again fails as it does for a user (executorch 1.5.1), so a
    block that reuses it fails here; ``make_edge()`` gives one that lowers."""
    from executorch.exir.pass_base import ExportPassBaseError

    _, base, pristine = workdir
    with pytest.raises(ExportPassBaseError, match="Unsupported target type"):
        base["edge"].to_executorch(base["config"])
    program = base["make_edge"]().to_executorch(base["config"]).buffer
    assert program == (pristine / "model.pte").read_bytes()   # the model.pte the names block wrote
    assert set(base) >= {"make_edge", "config", "weight_tensor", "state_dict"}
    assert not {"programs", "partitioners", "manager", "outdir"} & set(base)


@pytest.mark.parametrize("where,language,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_doc_block_runs(workdir, where, language, code, monkeypatch):
    reason = _skip_reason(language, code)
    if reason:
        pytest.skip(reason)
    root, base, pristine = workdir
    namespace = _state_of(where.rsplit(":", 1)[0], root, base, pristine)
    monkeypatch.chdir(root)
    if language == "python":
        import ptdstream

        try:
            exec(compile(code, where, "exec"), namespace)
        finally:
            ptdstream.uninstall()  # a block may install(): later tests need upstream's own writers
        return
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", _shell(code)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=SAFETY_S)
    assert proc.returncode == 0, (f"{where} exited {proc.returncode}\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
