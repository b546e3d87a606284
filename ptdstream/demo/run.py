"""``ptdstream demo``: export a small LM, save it with ptdstream, prove the bytes.

Steps, in order:

1) :func:`build_demo`: a tied-embedding transformer LM (:mod:`ptdstream.demo.model`)
   exported twice with ``torch.export`` (``forward`` on 8 tokens, ``prefill`` on
   16), lowered with ``to_edge_transform_and_lower(..., [XnnpackPartitioner()])``
   and ``to_executorch``, every weight going to ``model.ptd``:

   * XNNPACK's constants: executorch 1.5.1 tags them through
     ``exir/passes/external_constants_pass.py::delegate_external_constants_pass_unlifted``,
     which sets ``node.meta["custom"]["delegate_constant_tag"]`` on the ``get_attr``
     nodes of an *unlifted* module (``ep.module()``), re-exported afterwards; the
     XNNPACK node visitor (``backends/xnnpack/operators/node_visitor.py``) then
     adds each constant to the ``NamedDataStore`` under its SHA-256 hex with that
     external tag (alignment 16) instead of the .pte;
   * the rest (the embedding table, norms, masks): ``ExecutorchBackendConfig(
     external_constants=<tag fn>)``, keyed by FQN (same recipe as
     ``examples/models/llama/export_llama_lib.py``).

2) :func:`run_demo` saves with ``ptdstream.save(manager, out/"model.pte")``,
   sampling RSS meanwhile (:class:`PeakRssSampler`);
3) compares the files with the manager's own serialized output, streamed from
   its ``Cord`` s (``ptdstream.check.compare.verify_against_manager``; nothing of the
   reference is written);
4) unless ``--no-run``: loads ``model.pte`` + ``model.ptd`` with
   ``executorch.runtime.Runtime.load_program(pte, data_path=ptd)`` and runs both
   methods against eager PyTorch;
5) prints the summary. Exit code 0 when identical and (if run) outputs match,
   1 otherwise.

Run it: ``python -m ptdstream.demo --out ./ptdstream-demo`` (or ``ptdstream demo``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from ..progress import Stages
from . import DATA_TAG, METHODS, check_folders
from .checks import ATOL, RuntimeCheck, TiedEmbedding, check_runtime, find_tied_embedding
from .rss import PeakRssSampler

__all__ = ["ATOL", "PeakRssSampler", "RuntimeCheck", "Stages", "TiedEmbedding", "backend_config",
           "build_demo", "export_programs", "format_summary", "lower", "main", "run_demo", "write_reference"]

if TYPE_CHECKING:  # imported where they are used: torch and the writer load only when the demo runs
    from ..check.compare import CompareReport
    from ..save import SaveReport
    from .model import TinyLM


@dataclass(frozen=True)
class DemoBuild:
    """The eager model, its lowered manager and the export timings (seconds)."""

    model: TinyLM
    manager: Any  # executorch ExecutorchProgramManager
    export_seconds: float
    lower_seconds: float


def export_programs(model) -> dict:
    """``{method: ExportedProgram}`` of the demo model, XNNPACK's weights tagged for
    ``model.ptd`` (see the module docstring)."""
    import torch
    from executorch.exir.passes.external_constants_pass import (
        delegate_external_constants_pass_unlifted,
    )

    programs = {}
    for name, seq_len in METHODS:
        example = (torch.zeros(1, seq_len, dtype=torch.long),)
        unlifted = torch.export.export(model, example, strict=False).module()
        # XNNPACK reads the tag from the get_attr nodes of the unlifted graph.
        delegate_external_constants_pass_unlifted(unlifted, gen_tag_fn=lambda node: DATA_TAG)
        programs[name] = torch.export.export(unlifted, example, strict=False)
    return programs


def lower(programs: dict):
    """The ``EdgeProgramManager`` of ``programs`` lowered to XNNPACK."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    return to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()])


def backend_config():
    """The ``ExecutorchBackendConfig`` of the demo: every remaining constant in ``model.ptd``."""
    from executorch.exir import ExecutorchBackendConfig

    return ExecutorchBackendConfig(external_constants=lambda node: DATA_TAG)


def build_demo(seed: int = 0, stages: Stages | None = None) -> DemoBuild:
    """Export, lower (XNNPACK) and emit the demo model, weights tagged external.

    CPU only; holds the model's weights a few times over (tens of MiB here).
    Takes about 15 s on two cores, most of it in ``to_edge_transform_and_lower``.
    """
    from .model import build_tiny_lm

    stages = stages or Stages(None, 2)
    model = build_tiny_lm(seed=seed)
    start = time.perf_counter()
    with stages.stage(f"export {len(METHODS)} methods with torch.export"):
        programs = export_programs(model)
    exported = time.perf_counter()
    with stages.stage("lower to XNNPACK and emit (to_edge_transform_and_lower, to_executorch)"):
        manager = lower(programs).to_executorch(backend_config())
    return DemoBuild(model, manager, exported - start, time.perf_counter() - exported)


@dataclass(frozen=True)
class DemoResult:
    """Everything the demo measured; ``exit_code`` is 0 only when all checks pass."""

    build: DemoBuild
    report: SaveReport
    rss_added_nbytes: int
    rss_method: str
    files: tuple[CompareReport, ...]  # the .pte first
    tied: TiedEmbedding
    runtime: RuntimeCheck | None  # None with --no-run
    reference: tuple[str, ...] = ()  # executorch's own files (--reference), the program first

    @property
    def identical(self) -> bool:
        """Whether there were files and each is byte-identical to upstream's."""
        return bool(self.files) and all(f.ok for f in self.files)

    @property
    def exit_code(self) -> int:
        """0 when the files are identical and the runtime check (if run) passed, else 1."""
        runtime_ok = self.runtime is None or self.runtime.ok
        return 0 if self.identical and runtime_ok else 1


def run_demo(out: str, *, no_run: bool = False, progress: bool = False,
             log: TextIO | None = None, reference: str | None = None) -> DemoResult:
    """Build, save into ``out`` (created if missing), verify and optionally run.

    Writes ``out/model.pte`` and ``out/model.ptd`` (replacing them atomically if
    present); nothing else is left in ``out``. With ``reference``, executorch's own
    serializer writes the same program into ``reference`` too (:func:`write_reference`).
    Each stage is announced on ``log`` (with its time) as it happens; ``progress``
    shows a bar while saving.
    """
    from ..check.compare import verify_against_manager
    from ..save import save

    stages = Stages(log, (4 if no_run else 5) + (reference is not None))
    build = build_demo(stages=stages)
    out = os.path.abspath(out)  # one style of path in every line the demo prints
    os.makedirs(out, exist_ok=True)
    pte_path = os.path.join(out, "model.pte")
    with stages.stage(f"save with ptdstream into {out}"), PeakRssSampler() as rss:
        report = save(build.manager, pte_path, progress=progress)
    with stages.stage("verify byte identity against executorch's serializer (streamed from the manager)"):
        files = tuple(verify_against_manager(build.manager, pte_path))
    written: list[str] = []
    if reference is not None:
        reference = os.path.abspath(reference)
        with stages.stage(f"write executorch's own files into {reference} (reference)"):
            written = write_reference(build.manager, reference)
    ptd_path = os.path.join(out, DATA_TAG + ".ptd")
    tied = find_tied_embedding(ptd_path, build.model.tok_embeddings.weight)
    runtime = None
    if not no_run:
        with stages.stage("run both methods with the ExecuTorch runtime and compare with eager PyTorch"):
            runtime = check_runtime(build.model, pte_path, ptd_path)
    return DemoResult(build, report, rss.added_nbytes, rss.method, files, tied, runtime, tuple(written))


def write_reference(manager, folder: str) -> list[str]:
    """Write ``manager``'s files with executorch's own serializer into ``folder`` (created if
    missing): ``model.pte`` (``manager.write_to_file``) and ``model.ptd``
    (``manager.write_tensor_data_to_file``); the paths, program first.

    Both are written into a fresh temp folder inside ``folder`` and renamed over any
    previous ones; on an error the temp folder is removed and ``folder`` is as it was
    (but for a file renamed before the failure). Memory: upstream's serializer holds
    each file whole.
    """
    import shutil
    import tempfile

    os.makedirs(folder, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".ptdstream-reference-", dir=folder)
    try:
        with open(os.path.join(scratch, "model.pte"), "wb") as f:
            manager.write_to_file(f)
        manager.write_tensor_data_to_file(scratch)
        names = ["model.pte", *sorted(n for n in os.listdir(scratch) if n != "model.pte")]
        for name in names[1:] + names[:1]:  # the data first, the program that names it last
            os.replace(os.path.join(scratch, name), os.path.join(folder, name))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return [os.path.join(folder, n) for n in names]


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _speed(report: SaveReport) -> str:
    """``: 1.23 GB/s`` of the save's write, from 64 MiB on (:func:`ptdstream.reports.rate`)."""
    from ..reports import rate

    speed = rate(report.nbytes, report.seconds - report.plan_seconds)
    return f": {speed}" if speed else ""


def format_summary(result: DemoResult) -> str:
    """The human-readable summary ``main`` prints."""
    model, report = result.build.model, result.report
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    methods = ", ".join(f"{n}[1x{t}]" for n, t in METHODS)
    lines = [
        f"model: TinyLM vocab {cfg.vocab_size}, dim {cfg.dim}, {cfg.n_layers} layers, "
        f"{cfg.n_heads} heads, {n_params:,} parameters (embedding tied to output); "
        f"methods {methods}",
        f"export {result.build.export_seconds:.1f} s, lower+emit (XNNPACK, weights "
        f"external, tag {DATA_TAG!r}) {result.build.lower_seconds:.1f} s",
        "files:",
    ]
    lines += [f"  {f.path}  {f.nbytes:,} bytes ({_mib(f.nbytes)})" for f in report.files]
    lines += [
        f"save: {report.nbytes:,} bytes in {report.seconds:.3f} s (planning {report.plan_seconds:.3f} s, then the "
        f"write, fsync and publish{_speed(report)})",
        f"peak RSS added by save: {_mib(result.rss_added_nbytes)} ({result.rss_method})",
        f"dedup: {report.dedup_saved_nbytes:,} bytes not written; tied embedding "
        f"{_mib(result.tied.nbytes)} in segment {result.tied.segment_index} under keys "
        + ", ".join(k if len(k) < 24 else k[:12] + "..." for k in result.tied.keys)
        + f"; stored {result.tied.copies}x",
    ]
    for f in result.files:
        lines.append(f"byte identity vs executorch serializer (streamed from the manager): {f.summary()}")
    if result.reference:
        lines.append("reference (executorch's own serializer): " + ", ".join(result.reference))
    if result.runtime is None:
        lines.append("runtime check: skipped (--no-run)")
    else:
        rt = result.runtime
        per = ", ".join(
            f"{n} max|diff| {d:.2e} {'ok' if rt.matches[n] else 'MISMATCH'}"
            for n, d in rt.max_abs_diff.items()
        )
        lines.append(
            f"runtime check (executorch.runtime, XnnpackBackend "
            f"{'registered' if rt.xnnpack_available else 'MISSING'}; atol {ATOL:g}): {per}"
        )
    lines.append("result: " + ("OK" if result.exit_code == 0 else "FAILED"))
    return "\n".join(lines)


def main(args: argparse.Namespace, stream: TextIO | None = None) -> int:
    """Run the demo with parsed ``args`` (``out``, ``no_run``); print the summary.

    Returns 0 when the files are byte-identical to executorch's serializer and,
    unless ``no_run``, the runtime's outputs match eager PyTorch; 1 otherwise.
    """
    stream = stream if stream is not None else sys.stdout
    refused = check_folders(args)  # before minutes of export, not after
    if refused is not None:
        print(refused, file=sys.stderr)
        return 2
    quiet = getattr(args, "quiet", False)
    progress = getattr(args, "progress", None)
    if progress is None:
        progress = sys.stderr.isatty()
    result = run_demo(args.out, no_run=args.no_run, progress=bool(progress) and not quiet,
                      log=None if quiet else sys.stderr, reference=getattr(args, "reference", None))
    if not quiet or result.exit_code:
        print(format_summary(result), file=stream if not quiet else sys.stderr)
    return result.exit_code
