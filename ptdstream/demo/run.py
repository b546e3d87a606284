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
import hashlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional, TextIO, Tuple

DATA_TAG = "model"  # every weight goes to <out>/model.ptd
METHODS: Tuple[Tuple[str, int], ...] = (("forward", 8), ("prefill", 16))  # (name, tokens)
ATOL = 1e-4
RTOL = 1e-4


@dataclass(frozen=True)
class DemoBuild:
    """The eager model, its lowered manager and the export timings (seconds)."""

    model: object  # ptdstream.demo.model.TinyLM
    manager: object  # executorch ExecutorchProgramManager
    export_seconds: float
    lower_seconds: float


def build_demo(seed: int = 0) -> DemoBuild:
    """Export, lower (XNNPACK) and emit the demo model, weights tagged external.

    CPU only; holds the model's weights a few times over (tens of MiB here).
    Takes about 15 s on two cores, most of it in ``to_edge_transform_and_lower``.
    """
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.external_constants_pass import (
        delegate_external_constants_pass_unlifted,
    )

    from .model import build_tiny_lm

    model = build_tiny_lm(seed=seed)
    start = time.perf_counter()
    programs = {}
    for name, seq_len in METHODS:
        example = (torch.zeros(1, seq_len, dtype=torch.long),)
        unlifted = torch.export.export(model, example, strict=False).module()
        # XNNPACK reads the tag from the get_attr nodes of the unlifted graph.
        delegate_external_constants_pass_unlifted(unlifted, gen_tag_fn=lambda node: DATA_TAG)
        programs[name] = torch.export.export(unlifted, example, strict=False)
    exported = time.perf_counter()
    edge = to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()])
    manager = edge.to_executorch(
        ExecutorchBackendConfig(external_constants=lambda node: DATA_TAG)
    )
    return DemoBuild(model, manager, exported - start, time.perf_counter() - exported)


class PeakRssSampler:
    """Context manager: the peak resident set size added while it is entered.

    A daemon thread reads ``/proc/self/statm`` every ``interval_s`` seconds (plus
    once on enter and once on exit); ``added_nbytes`` is the peak minus the value
    on enter, in bytes. Where ``/proc`` is missing it falls back to
    ``resource.getrusage`` ``ru_maxrss`` before/after, which only shows growth
    above the process's earlier lifetime peak (``method`` says which was used).
    A peak held for less than ``interval_s``, or inside one call that keeps the
    GIL, can be missed; the save loop releases the GIL on every write. Not
    reentrant; use one instance per measured region.
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.added_nbytes = 0
        self.samples = 0
        self._use_proc = os.path.exists("/proc/self/statm")
        self.method = (
            f"/proc/self/statm sampled every {interval_s * 1e3:g} ms by a background thread"
            if self._use_proc
            else "resource.getrusage ru_maxrss before/after (growth above earlier peak only)"
        )
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._baseline = 0
        self._peak = 0

    @staticmethod
    def _rss_nbytes() -> int:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @staticmethod
    def _maxrss_nbytes() -> int:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # macOS bytes, Linux KiB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def _sample(self) -> None:
        self._peak = max(self._peak, self._rss_nbytes())
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "PeakRssSampler":
        if self._use_proc:
            self._baseline = self._peak = self._rss_nbytes()
            self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
            self._thread.start()
        else:
            self._baseline = self._maxrss_nbytes()
        return self

    def __exit__(self, *exc) -> None:
        if self._use_proc:
            self._stop.set()
            self._thread.join()
            self._sample()
        else:
            self._peak = self._maxrss_nbytes()
        self.added_nbytes = max(0, self._peak - self._baseline)


@dataclass(frozen=True)
class TiedEmbedding:
    """Where the tied embedding's bytes sit in a .ptd.

    ``keys`` all name segment ``segment_index`` (``nbytes`` long);
    ``copies`` counts the segments holding those bytes (1 = stored once).
    """

    keys: Tuple[str, ...]
    segment_index: int
    nbytes: int
    copies: int


def find_tied_embedding(ptd_path: str, weight) -> TiedEmbedding:
    """Locate ``weight`` (a contiguous CPU tensor) in ``ptd_path``.

    Reads the file's section map with :func:`ptdstream.format.reader.read_artifact` and
    only the segments of the tensor's size. XNNPACK names the tensor by the
    SHA-256 hex of its bytes; the emitter names it by FQN.

    Raises:
        KeyError: the SHA-256 key is not in the file.
    """
    from ..format.reader import read_artifact

    data = weight.detach().contiguous().numpy().tobytes()
    art = read_artifact(ptd_path)
    key = hashlib.sha256(data).hexdigest()
    index = art.keys[key]
    keys = tuple(k for k, i in art.keys.items() if i == index)
    copies = 0
    with open(ptd_path, "rb") as f:
        for seg in art.segments:
            if seg.nbytes == len(data):
                f.seek(seg.start)
                copies += f.read(seg.nbytes) == data
    return TiedEmbedding(keys, index, len(data), copies)


@dataclass(frozen=True)
class RuntimeCheck:
    """ExecuTorch runtime outputs against eager PyTorch, per method."""

    max_abs_diff: Dict[str, float]
    matches: Dict[str, bool]
    xnnpack_available: bool

    @property
    def ok(self) -> bool:
        return all(self.matches.values())


def check_runtime(model, pte_path: str, ptd_path: str, seed: int = 1) -> RuntimeCheck:
    """Run every demo method with the ExecuTorch runtime and compare with ``model``.

    Loads through ``executorch.runtime.Runtime.load_program(pte, data_path=ptd)``
    (1.5.1's Python API taking a .ptd), on fresh random tokens drawn from
    ``seed``; outputs match when ``torch.allclose(atol=ATOL, rtol=RTOL)``.
    """
    import torch
    from executorch.runtime import Runtime

    runtime = Runtime.get()
    program = runtime.load_program(pte_path, data_path=ptd_path)
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    diffs, matches = {}, {}
    for name, seq_len in METHODS:
        tokens = torch.randint(0, vocab, (1, seq_len), generator=generator)
        got = program.load_method(name).execute([tokens])[0]
        with torch.no_grad():
            want = model(tokens)
        diffs[name] = float((got - want).abs().max())
        matches[name] = bool(torch.allclose(got, want, atol=ATOL, rtol=RTOL))
    return RuntimeCheck(diffs, matches, runtime.backend_registry.is_available("XnnpackBackend"))


@dataclass(frozen=True)
class DemoResult:
    """Everything the demo measured; ``exit_code`` is 0 only when all checks pass."""

    build: DemoBuild
    report: object  # ptdstream.SaveReport
    rss_added_nbytes: int
    rss_method: str
    files: Tuple[object, ...]  # ptdstream.check.compare.CompareReport, the .pte first
    tied: TiedEmbedding
    runtime: Optional[RuntimeCheck]  # None with --no-run

    @property
    def identical(self) -> bool:
        return bool(self.files) and all(f.ok for f in self.files)

    @property
    def exit_code(self) -> int:
        runtime_ok = self.runtime is None or self.runtime.ok
        return 0 if self.identical and runtime_ok else 1


def run_demo(out: str, *, no_run: bool = False, progress: bool = True) -> DemoResult:
    """Build, save into ``out`` (created if missing), verify and optionally run.

    Writes ``out/model.pte`` and ``out/model.ptd`` (replacing them atomically if
    present); nothing else is left in ``out``.
    """
    from ..check.compare import verify_against_manager
    from ..save import save

    build = build_demo()
    os.makedirs(out, exist_ok=True)
    pte_path = os.path.join(out, "model.pte")
    with PeakRssSampler() as rss:
        report = save(build.manager, pte_path, progress=progress)
    # Streams the manager's own serialized Cords against the files; writes nothing.
    files = tuple(verify_against_manager(build.manager, pte_path))
    ptd_path = os.path.join(out, DATA_TAG + ".ptd")
    tied = find_tied_embedding(ptd_path, build.model.tok_embeddings.weight)
    runtime = None if no_run else check_runtime(build.model, pte_path, ptd_path)
    return DemoResult(build, report, rss.added_nbytes, rss.method, files, tied, runtime)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


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
        f"save: {report.nbytes:,} bytes in {report.seconds:.3f} s ({report.gbps:.3f} GB/s; "
        f"planning {report.plan_seconds:.3f} s)",
        f"peak RSS added by save: {_mib(result.rss_added_nbytes)} ({result.rss_method})",
        f"dedup: {report.dedup_saved_nbytes:,} bytes not written; tied embedding "
        f"{_mib(result.tied.nbytes)} in segment {result.tied.segment_index} under keys "
        + ", ".join(k if len(k) < 24 else k[:12] + "..." for k in result.tied.keys)
        + f"; stored {result.tied.copies}x",
    ]
    for f in result.files:
        lines.append(f"byte identity vs executorch serializer (streamed from the manager): {f.summary()}")
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


def main(args: argparse.Namespace, stream: Optional[TextIO] = None) -> int:
    """Run the demo with parsed ``args`` (``out``, ``no_run``); print the summary.

    Returns 0 when the files are byte-identical to executorch's serializer and,
    unless ``no_run``, the runtime's outputs match eager PyTorch; 1 otherwise.
    """
    stream = stream if stream is not None else sys.stdout
    try:  # before minutes of export, not after
        os.makedirs(args.out, exist_ok=True)
        if not os.access(args.out, os.W_OK):
            raise PermissionError(13, "folder is not writable", args.out)
    except (FileExistsError, NotADirectoryError):
        print(f"ptdstream demo: --out {args.out} exists and is not a folder", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"ptdstream demo: cannot create the output folder {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    result = run_demo(args.out, no_run=args.no_run)
    print(format_summary(result), file=stream)
    return result.exit_code


def parser() -> argparse.ArgumentParser:
    """The parser of ``python -m ptdstream.demo``."""
    from . import add_arguments

    return add_arguments(
        argparse.ArgumentParser(
            prog="python -m ptdstream.demo",
            description="Export a small tied-embedding LM to .pte + .ptd (XNNPACK), save it "
            "with ptdstream, check byte identity with executorch's serializer and run it.",
            epilog="examples:\n  python -m ptdstream.demo --out /tmp/demo\n"
            "  python -m ptdstream.demo --no-run\nexit codes: 0 ok, 1 mismatch, 2 usage",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
