"""Hugging Face models through optimum-executorch, saved by ptdstream.

optimum-executorch 1.1.0 saves in one place,
``optimum/exporters/executorch/convert.py::export_to_executorch``: for each
``ExecutorchProgramManager`` its recipe returns, ``manager.write_to_file(f)``
into ``<output_dir>/<name>.pte`` (a file it opened with ``"wb"``), then
``manager.write_tensor_data_to_file(output_dir)``. :func:`ptdstream.install`
(:mod:`ptdstream.hooks.install`) takes over both, so every ``.pte``/``.ptd`` it writes comes from ptdstream's
streaming writer, byte for byte what executorch 1.5.1's writer gives on the
same manager. :func:`export` and :func:`main` add
:func:`ptdstream.constants_by_reference` and
:func:`~ptdstream.hooks.xnnpack.xnnpack_constants_by_reference` around the
whole export, so the emitter (the embedding table, constants XNNPACK does not
take) and XNNPACK's lowering (the weights it takes unchanged) keep references to
tensors instead of ``bytes`` copies.

Both of optimum-executorch's entry points run here with ptdstream saving:
:func:`run_main_export` (``optimum.exporters.executorch.main_export``) and
:func:`run_optimum_cli` (the ``optimum-cli`` command); :mod:`ptdstream.hf.routes`
and :mod:`ptdstream.hf.cli` call them, after their own checks.

Needs ``pip install "ptdstream[hf]"`` (optimum-executorch 1.1.0, transformers
5.0.0rc1). Nothing here downloads: pass a local folder, and set
``HF_HUB_OFFLINE=1`` to make huggingface_hub refuse any network access.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..reports import Report

__all__ = ["ExportReport", "quiet_export", "run_main_export", "run_optimum_cli", "saving_with_ptdstream"]

#: Loggers whose import-time warnings an export prints and a user cannot act on
#: (coremltools: untested torch and scikit-learn versions, its missing native library).
_NOISY_LOGGERS = ("coremltools",)


@dataclass(frozen=True)
class ExportReport(Report):
    """The ``.pte``/``.ptd`` files an export wrote (or replaced) in ``output_dir``:
    ``(path, nbytes)`` each, the program(s) first, and the export's wall time in seconds."""

    output_dir: str
    files: tuple[tuple[str, int], ...]
    seconds: float

    @property
    def nbytes(self) -> int:
        """Bytes written, over every file."""
        return sum(n for _, n in self.files)

    derived = ("nbytes",)

    def summary(self) -> str:
        """One line per file, then the total."""
        lines = [f"  {path}  {nbytes:,} bytes" for path, nbytes in self.files]
        return "\n".join([f"saved by ptdstream in {self.output_dir}:", *lines,
                          f"{len(self.files)} file{'s' * (len(self.files) != 1)}, {self.nbytes:,} bytes; "
                          f"export and save {self.seconds:.1f} s"])


def _artifacts(folder: str) -> dict[str, tuple[int, int, int]]:
    """``{name: (inode, mtime_ns, size)}`` of the .pte/.ptd files directly in ``folder``."""
    try:
        with os.scandir(folder) as entries:
            return {e.name: (e.inode(), e.stat().st_mtime_ns, e.stat().st_size) for e in entries
                    if e.name.endswith((".pte", ".ptd")) and e.is_file(follow_symlinks=False)}
    except (FileNotFoundError, NotADirectoryError):
        return {}


@contextlib.contextmanager
def _reporting(output_dir: str, report: list[ExportReport]) -> Iterator[None]:
    """Append to ``report`` the files the body wrote or replaced in ``output_dir``."""
    before, start = _artifacts(output_dir), time.perf_counter()
    yield
    after = _artifacts(output_dir)
    names = sorted((n for n, st in after.items() if before.get(n) != st), key=lambda n: (n.endswith(".ptd"), n))
    report.append(ExportReport(output_dir, tuple((os.path.join(output_dir, n), after[n][2]) for n in names),
                               time.perf_counter() - start))


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """Inside: ``FutureWarning`` s (torch and executorch deprecations raised from
    optimum's and executorch's code) are not shown, and coremltools' import-time
    warnings are not logged; both are put back on leaving. Not thread-safe (Python's
    warnings filters are process-wide). ``PTDSTREAM_DEBUG=1`` keeps everything."""
    if os.environ.get("PTDSTREAM_DEBUG"):
        yield
        return
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


@contextlib.contextmanager
def saving_with_ptdstream(by_reference: bool = True) -> Iterator[None]:
    """Inside: executorch's save methods are ptdstream's
    (:func:`ptdstream.hooks.install.installed`) and, with ``by_reference``,
    the emitter and XNNPACK's lowering keep constants by reference
    (:func:`ptdstream.constants_by_reference`,
    :func:`ptdstream.hooks.xnnpack.xnnpack_constants_by_reference`).

    Nests with :func:`ptdstream.install`: an install made before entering stays
    after leaving (the patches are restored by the last exit).
    """
    from ..hooks.emitter import constants_by_reference  # executorch and torch: when an export runs
    from ..hooks.install import installed
    from ..hooks.xnnpack import xnnpack_constants_by_reference

    with contextlib.ExitStack() as stack:
        stack.enter_context(installed())
        if by_reference:
            stack.enter_context(constants_by_reference())
            stack.enter_context(xnnpack_constants_by_reference())
        yield


def run_main_export(model_dir: str, output_dir: str, task: str = "text-generation", recipe: str = "xnnpack", *,
                    by_reference: bool = True, quiet: bool = False, progress: bool = False,
                    **options) -> dict[str, object]:
    """``optimum.exporters.executorch.main_export`` with ptdstream saving.

    Args:
        model_dir: a local Hugging Face model folder (``config.json`` and
            safetensors weights, as ``save_pretrained`` writes them).
        output_dir: where ``<name>.pte`` (``model.pte`` for every recipe of
            1.1.0) and any ``<tag>.ptd`` go; created if missing (by optimum).
        task: optimum-executorch's task name (``"text-generation"``,
            ``"fill-mask"``, ``"image-classification"``,
            ``"automatic-speech-recognition"``, ...). Defaults to
            ``"text-generation"``, as optimum-cli's ``--task`` does; a folder of
            another kind of model needs its task named (optimum's task registry,
            ``optimum/exporters/executorch/tasks/``, loads the model class from it).
        recipe: ``"xnnpack"`` or ``"portable"`` on a CPU machine.
        by_reference: also keep constants by reference in the emitter and in
            XNNPACK's lowering (saves one host copy of every constant they take
            unchanged; the files are the same bytes).
        quiet: print no save report. Otherwise, when the export returns, the files it
            wrote are printed on stderr (:class:`ExportReport`: each path and size, the
            time).
        progress: print each stage on stderr as it begins and ends, with its
            seconds: load, ``torch.export`` of each method, lowering and emission,
            save (:mod:`ptdstream.hf.stages`).
        **options: optimum's own task options, passed on unchanged:
            ``qlinear="8da4w"``, ``qembedding="8w"``, ``use_custom_sdpa=True``,
            ``use_custom_kv_cache=True``, ``max_seq_len=...``, ``dtype=...``.

    FutureWarnings and coremltools' import warnings are silenced for the call
    (:func:`quiet_export`).

    Returns:
        ``{name: ExecutorchProgramManager}`` as ``main_export`` returns it.

    Raises:
        ImportError: optimum-executorch is not installed (``ptdstream[hf]``).
        PtdstreamError: a save failed (upstream's writer would have logged).
    """
    stages = _stages(progress)
    from optimum.exporters.executorch import main_export

    report: list[ExportReport] = []
    with quiet_export(), saving_with_ptdstream(by_reference), _reporting(os.fspath(output_dir), report), \
            _staged(stages, os.fspath(model_dir)):
        managers = main_export(model_dir, task=task, recipe=recipe, output_dir=output_dir, **options)
    if not quiet:
        print(report[0].summary(), file=sys.stderr)
    return managers


def run_optimum_cli(argv: Sequence[str] | None = None, *, progress: bool = False, quiet: bool = False) -> int:
    """``optimum-cli`` with ptdstream saving; arguments as ``optimum-cli`` takes them.

    ``argv``: optimum-cli's arguments, e.g. ``export executorch -m DIR --task
    fill-mask --recipe xnnpack -o OUT [--qlinear 8da4w] [--use_custom_sdpa]``.
    Constants are kept by reference during the export, FutureWarnings and
    coremltools' import warnings silenced (:func:`quiet_export`), and the files
    written into ``-o``/``--output_dir`` are printed on stderr at the end
    (:class:`ExportReport`; not with ``quiet``). With ``progress``, each stage is
    printed on stderr as it begins and ends (:mod:`ptdstream.hf.stages`).
    Returns 0; optimum's own errors propagate (its parser exits 2 on bad arguments).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    stages = _stages(progress and _is_export(args))
    from optimum.commands.optimum_cli import main as optimum_cli_main

    saved = sys.argv
    sys.argv = ["optimum-cli", *args]
    output_dir = _output_dir(args)
    report: list[ExportReport] = []
    try:
        with quiet_export(), saving_with_ptdstream(by_reference=True), contextlib.ExitStack() as stack:
            if output_dir is not None:
                stack.enter_context(_reporting(output_dir, report))
            stack.enter_context(_staged(stages, _option_value(args, ("-m", "--model")) or ""))
            optimum_cli_main()
    finally:
        sys.argv = saved
    if report and not quiet:
        print(report[0].summary(), file=sys.stderr)
    return 0


def _stages(progress: bool):
    """The :class:`~ptdstream.progress.Stages` of an export on stderr with ``progress``
    (else None), its first stage begun when optimum is still to be imported (tens of
    seconds on a loaded machine: torch, transformers, torchao, executorch)."""
    if not progress:
        return None
    from ..progress import Stages

    stages = Stages(sys.stderr, elapsed=True)
    if "optimum.exporters.executorch" not in sys.modules:
        stages.begin("import torch, executorch, transformers and optimum-executorch")
    return stages


def _staged(stages, model_dir: str) -> contextlib.AbstractContextManager[None]:
    """The stages of the export on ``stages`` (:func:`ptdstream.hf.stages.export_stages`),
    or nothing for None. Entered innermost (see that module)."""
    if stages is None:
        return contextlib.nullcontext()
    from .stages import export_stages

    return export_stages(stages, model_dir)


def _is_export(args: Sequence[str]) -> bool:
    """Whether optimum-cli's arguments run an export (not ``--help``)."""
    return list(args[:2]) == ["export", "executorch"] and not {"-h", "--help"} & set(args)


def _output_dir(args: Sequence[str]) -> str | None:
    """The value of optimum-cli's ``-o``/``--output_dir`` in ``args``, if given."""
    return _option_value(args, ("-o", "--output_dir"))


def _option_value(args: Sequence[str], names: tuple[str, str]) -> str | None:
    """The value of the short or long option ``names`` in ``args`` (``-o OUT``,
    ``--output_dir OUT``, ``--output_dir=OUT``), if given."""
    for i, arg in enumerate(args):
        if arg in names and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(names[1] + "="):
            return arg.split("=", 1)[1]
    return None

