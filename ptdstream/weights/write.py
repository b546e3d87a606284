"""New weights for an exported program: the ``.ptd`` files it loads, straight from a
checkpoint, without re-exporting.

A program exported with its constants outside the ``.pte``
(``ExecutorchBackendConfig(external_constants=True)`` or a tagging callable)
names each weight by its fully qualified name (FQN), with its ScalarType, sizes
and dim order. :func:`write_ptd` reads those from the ``.pte`` (metadata only),
takes each tensor from a checkpoint (:mod:`ptdstream.sources.checkpoint`), checks
it, and streams every ``<tag>.ptd`` as upstream would have written it:

upstream (executorch 1.5.1, ``exir/_serialize/_serialize.py::serialize_for_executorch``)
adds the emitter's external constants to a fresh ``NamedDataStore`` tag by tag,
FQN by FQN, in emission order, with alignment 1 and the layout the program
records, then serializes each tag with ``FlatTensorSerializer``. Emission order
is the order in which the FQNs first appear in the program's execution plans'
values (``exir/emit/_emitter.py::_tensor_spec_to_evalue`` appends each value as
it emits it), so it is read from the ``.pte``; the tag is not in the ``.pte``:
it is ``_default_external_constant`` for ``external_constants=True``
(``exir/passes/external_constants_pass.py``), or taken from the ``.ptd`` files of
the original export (``like=``), which also fixes the key order.

The ``.pte`` of a re-export is the same bytes, except where the new weights
fall into other equal-content classes than the old ones (two biases equal at
export, different now, or the reverse): the emitter records each tensor's
``data_buffer_idx`` (its SHA-256 dedup index) in the program. The runtime loads
external tensors by FQN and does not read that index, so the old ``.pte`` runs
the new weights right; :class:`WeightsReport` names such keys.

Which exports qualify: programs whose every external weight is a plain
constant under its FQN and which hold no delegate. A delegate keeps its
weights inside its blob or as named data under keys derived from the bytes it
packed, so new weights change the ``.pte`` too: such programs are refused,
naming each delegate and, with ``like=``, each key of a delegate. One
exception: XNNPACK with tagged external weights (keys: the SHA-256 of the
bytes it stores), given the old ``.ptd`` files and the old weights, where it
stored the weights untransformed (:mod:`ptdstream.weights.xnnpack`): then the
new ``.pte`` is written too, byte-identical to a re-export's.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..defaults import CHUNK_NBYTES, WINDOW_NBYTES
from ..errors import CheckpointMismatchError
from ..reports import Report, rate
from ..sources.checkpoint import open_checkpoint
from ..sources.checkpoint_base import Checkpoint
from .check import KeyMap, check_keys, mapper, tags_and_order

__all__ = ["DEFAULT_TAG", "WeightsReport", "read_program_weights", "write_ptd"]

#: The tag ``external_constants=True`` gives every constant (``external_constants_pass.py``).
DEFAULT_TAG = "_default_external_constant"
#: ``FlatTensorConfig.segment_alignment`` (``extension/flat_tensor/serialize/serialize.py``).
DEFAULT_SEGMENT_ALIGNMENT = 128


@dataclass(frozen=True)
class ProgramWeights:
    """What a ``.pte`` expects: ``keys`` ``{fqn: upstream TensorLayout}`` in emission
    order, ``delegates`` ``[(method, backend id)]``, and ``buffer_index`` ``{fqn:
    data_buffer_idx}``: the emitter's index into its external constant buffers,
    shared by FQNs whose bytes were equal (SHA-256) when the program was exported."""

    path: str
    keys: dict[str, Any]
    delegates: tuple[tuple[str, str], ...]
    buffer_index: dict[str, int] = field(default_factory=dict)


def read_program_weights(path: str) -> ProgramWeights:
    """The external weights of the ``.pte`` at ``path`` (reads only its metadata,
    once, with the bounds-checked reader :func:`~ptdstream.format.reader.read_artifact`).

    Each layout is an upstream ``TensorLayout``, as
    ``exir/_serialize/_serialize.py::_extract_external_tensor_layouts`` gives it.

    Raises:
        FormatError: not a valid ``.pte``.
        ValueError: a tensor's ScalarType is none of executorch's.
    """
    from executorch.exir.scalar_type import ScalarType
    from executorch.exir.tensor_layout import TensorLayout

    from ..errors import FormatError
    from ..format.reader import read_artifact

    path = os.fspath(path)
    art = read_artifact(path)
    if art.kind != "pte":
        raise FormatError(f"{path}: is a .ptd, not a program (.pte)")
    layouts = {t.fqn: TensorLayout(ScalarType(t.layout.scalar_type), list(t.layout.sizes), list(t.layout.dim_order))
               for t in art.external_tensors}
    buffer_index = {t.fqn: t.buffer_index for t in art.external_tensors}
    return ProgramWeights(path, layouts, art.delegates, buffer_index)


def _changed_classes(keys, before: Mapping[str, int], after: Mapping[str, int]) -> tuple[str, ...]:
    """Keys (in ``keys`` order) whose equal-content class differs between two
    ``{key: buffer index}`` maps (each class named by its first key)."""
    first_before: dict[int, str] = {}
    first_after: dict[int, str] = {}
    changed = []
    for key in keys:
        if key not in before or key not in after:
            continue
        if first_before.setdefault(before[key], key) != first_after.setdefault(after[key], key):
            changed.append(key)
    return tuple(changed)


@dataclass(frozen=True)
class WeightsReport(Report):
    """What :func:`write_ptd` wrote: ``files`` (``FileReport``, one per tag), bytes in
    all, the call's wall seconds (``seconds``: the checkpoint opened and checked, the
    files planned, written; a first call in a process also imports executorch),
    GB/s of the write (``gbps``), bytes not written thanks to dedup, keys written,
    and ``write_seconds``: the write itself (temp files written, fsynced and
    published), the span ``gbps`` and the summary's rate measure.

    ``pte_classes_changed``: keys whose equal-content class differs from the one
    the program was exported with (say two biases were equal and no longer
    are). A re-export would then also change the ``.pte``: the emitter's
    ``data_buffer_idx`` of those tensors. The runtime loads external tensors by
    FQN and does not read that index, so the program runs with the new ``.ptd``
    all the same; only a byte comparison of the
    ``.pte`` with a re-export's would differ."""

    files: tuple
    nbytes: int
    seconds: float
    gbps: float
    dedup_saved_nbytes: int
    keys: int
    pte_classes_changed: tuple[str, ...] = ()
    write_seconds: float = 0.0

    def summary(self) -> str:
        """One line per file, then keys, bytes, the write's seconds (its rate from 64 MiB
        on: :data:`~ptdstream.reports.RATE_MIN_NBYTES`) and the time before it."""
        lines = [f"{f.path}  {f.nbytes:,} bytes" for f in self.files]
        speed = rate(self.nbytes, self.write_seconds)
        lines.append(f"{self.keys} keys, {self.nbytes:,} bytes written in {self.write_seconds:.2f} s (the write, "
                     f"fsync and publish{': ' + speed if speed else ''}; checking and planning before it "
                     f"{self.seconds - self.write_seconds:.2f} s); dedup saved {self.dedup_saved_nbytes:,} bytes")
        if self.pte_classes_changed:
            lines.append(f"note: {len(self.pte_classes_changed)} key(s) no longer share content as they did at "
                         f"export ({', '.join(map(repr, self.pte_classes_changed[:10]))}): a re-export's .pte "
                         "would differ in their data_buffer_idx, which the runtime does not read")
        return "\n".join(lines)


def plan_ptd_files(program, checkpoint: Checkpoint, out_dir: str, *, like: Sequence[str] = (),
                   tag=None, key_map: KeyMap = None, allow_extra: bool = False,
                   segment_alignment: int = DEFAULT_SEGMENT_ALIGNMENT, old_checkpoint: Checkpoint | None = None,
                   keep: Sequence[str] = ()):
    """Check ``checkpoint`` against ``program`` and plan every ``.ptd`` (nothing written).

    Returns ``(SavePlan, keys, pte_classes_changed)``: the plan of the ``.ptd``
    files (and of the new ``.pte`` for XNNPACK), the number of keys, and the keys
    whose equal-content class changed (:class:`WeightsReport`). Arguments and
    errors: see :func:`write_ptd`.
    """
    from ..format.plan import FileRole, PlannedFile, SavePlan
    from ..format.ptd import plan_data_files, ptd_file_name
    from ..format.pte import PteOptions
    from ..sources import FileRangeSource
    from ..store import StreamingNamedDataStore
    from . import xnnpack as xnn

    weights = program if isinstance(program, ProgramWeights) else read_program_weights(program)
    problems: list[str] = []
    xnnpack = bool(like) and old_checkpoint is not None and xnn.delegates_all_xnnpack(list(weights.delegates))
    if not xnnpack:
        for (method, backend), count in Counter(weights.delegates).items():
            held = f"a {backend} delegate" if count == 1 else f"{count} {backend} delegates"
            problems.append(
                f"delegate: method {method!r} holds {held}; its weights live in its blob or "
                "under keys derived from the bytes it packed, so new weights need a new .pte (re-export"
                + (", or for XNNPACK: like= / --like the old .ptd files and old_checkpoint= / --old the "
                   "exported weights)" if backend == xnn.XNNPACK_ID else ")")
            )
    order, foreign, located = tags_and_order(weights, like, DEFAULT_TAG if tag is None else tag, problems)
    kept = set(keep)
    for key in keep:
        if key not in located:
            problems.append(f"keep: {key!r} is in none of the like= files" if like else
                            f"keep: {key!r} needs the old .ptd files that hold it (like= / --like)")
    foreign = [key for key in foreign if key not in kept]
    matches: dict[str, tuple[str, str]] = {}
    if foreign and not xnnpack:
        for key in foreign:
            problems.append(f"key {key!r} of a like= file is not an external weight of {weights.path}: named data "
                            "of a delegate or backend (XNNPACK names what it packs by the SHA-256 of the packed "
                            "bytes), which a checkpoint alone cannot recreate")
    elif foreign:
        matches = xnn.match_keys(foreign, old_checkpoint, checkpoint, problems, mapper(key_map))
    for t in order:
        try:
            ptd_file_name(t)  # a tag must name a file in out_dir
        except ValueError as e:
            problems.append(str(e))
    chosen = check_keys(weights, checkpoint, key_map, allow_extra, problems,
                        also_used={name for name, _ in matches.values()}, keep=kept, located=located)
    places = xnn.find_all(weights.path, list(matches), problems) if matches else {}
    if problems:
        raise CheckpointMismatchError(weights.path, checkpoint.path, problems)
    store = StreamingNamedDataStore()
    for t, keys in order.items():
        for key in keys:
            if key in matches:  # XNNPACK's named data: its new bytes under their SHA-256
                name, new_key = matches[key]
                store.add_named_data(new_key, checkpoint.source(name), alignment=xnn.XNNPACK_ALIGNMENT,
                                     external_tag=t)
            elif key in kept:  # the exported bytes, from the old .ptd
                path, offset, nbytes = located[key]
                layout = weights.keys.get(key)
                store.add_named_data(key, FileRangeSource(path, offset, nbytes), external_tag=t,
                                     alignment=1 if layout is not None else xnn.XNNPACK_ALIGNMENT,
                                     tensor_layout=layout)
            else:
                store.add_named_data(key, checkpoint.source(chosen[key]), external_tag=t,
                                     tensor_layout=weights.keys[key])
    output = store.get_named_data_store_output()
    files = plan_data_files(output.buffers, output.external_data, out_dir, segment_alignment=segment_alignment,
                            fingerprints=output.fingerprints)
    after = {key: entry.buffer_index for entries in output.external_data.values() for key, entry in entries.items()}
    changed = _changed_classes(weights.keys, weights.buffer_index, after)
    program_file = None
    if matches:
        name = os.path.basename(weights.path)
        replacements = {at: (k, new_key) for k, (_, new_key) in matches.items() for at in places[k]}
        program_file = PlannedFile(os.path.join(out_dir, name), FileRole.PROGRAM,
                                   xnn.rewritten_program_plan(weights.path, replacements, name))
    plan = SavePlan(files, program_file, PteOptions(segment_alignment=segment_alignment), store.dedup_saved_nbytes)
    return plan, len(chosen) + len(kept), changed


def write_ptd(program: str, checkpoint: str | Checkpoint, out_dir: str, *,
              like: Sequence[str] = (), tag: None | str | Mapping[str, str] | Callable[[str], str] = None,
              key_map: KeyMap = None, allow_extra: bool = False,
              segment_alignment: int = DEFAULT_SEGMENT_ALIGNMENT,
              chunk_nbytes: int = CHUNK_NBYTES, window_nbytes: int = WINDOW_NBYTES,
              progress: Any = False, old_checkpoint: None | str | Checkpoint = None,
              format: str = "auto", old_format: str = "auto", keep: Sequence[str] = (),
              force: bool = True) -> WeightsReport:
    """Write every ``.ptd`` that ``program`` loads, from ``checkpoint``'s tensors
    (and, for XNNPACK with ``old_checkpoint``, the new ``.pte``).

    The files are byte-identical to the ``.ptd`` files executorch 1.5.1 writes for
    the same program exported with the checkpoint's weights (same code, same
    config), when the program qualifies (module docstring). All are written to
    temp files, synced, then published together (like :func:`ptdstream.save`).

    Args:
        program: path of the ``.pte`` (only its metadata is read).
        checkpoint: a path (``.safetensors``, a Hugging Face index or folder, a
            ``torch.save`` file, a DCP folder with ``format="dcp"``; see
            :func:`~ptdstream.sources.checkpoint.open_checkpoint`) or an open
            :class:`~ptdstream.sources.checkpoint_base.Checkpoint`.
        out_dir: existing folder for the ``<tag>.ptd`` files.
        like: the ``.ptd`` files of the original export: each key's tag is the
            name of the file holding it and the key order is theirs.
        tag: without ``like``: the tag of every key (str), or ``{fqn: tag}``, or a
            callable ``fqn -> tag``; default ``_default_external_constant``.
        key_map: program FQN -> checkpoint key: ``{program_prefix:
            checkpoint_prefix}`` (the first matching prefix is replaced; several
            FQNs may name one checkpoint key) or a callable ``fqn -> key``
            (None: no key, reported missing).
        allow_extra: ignore checkpoint keys that are not weights of the program
            (otherwise each is reported).
        segment_alignment: bytes; the ``FlatTensorSerializer``'s (128 by default).
        chunk_nbytes: piece size in bytes; window_nbytes: bytes between page drops.
        progress: ``True`` for a tqdm bar, a callable taking byte counts, or
            ``False`` / ``None`` (:mod:`ptdstream.progress`).
        old_checkpoint: for a program with XNNPACK delegates and tagged external
            weights (with ``like``): the weights it was exported with, with the
            key names of ``checkpoint`` or the program's FQNs (``key_map`` then
            gives each one's key in ``checkpoint``). Each XNNPACK key whose bytes are exactly one
            old tensor (stored untransformed) gets the new tensor's bytes under
            its SHA-256, and a new ``.pte`` is written to ``out_dir`` too: the old
            one with those keys replaced (:mod:`ptdstream.weights.xnnpack`);
            transformed weights are refused by key. Both checkpoints are read
            once more to take SHA-256 digests.
        format, old_format: how to read ``checkpoint`` and ``old_checkpoint``
            given as paths: ``"auto"`` (safetensors, a Hugging Face index or
            folder, or a ``torch.save`` file read with ``weights_only=True``),
            ``"safetensors"``, ``"torch"``, or ``"dcp"``: a
            torch.distributed.checkpoint folder, whose metadata is a pickle
            that runs code when read, so name it only for a trusted checkpoint
            (it is never detected).
        keep: keys (FQNs, or XNNPACK keys) whose exported bytes are copied
            unchanged from the ``like`` file holding them, not taken from
            ``checkpoint``: buffers no checkpoint saves, such as non-persistent
            ones (causal masks). A missing key that a ``like`` file holds is
            reported with this option named.
        force: replace existing files in ``out_dir`` (``False``: refuse them,
            as the CLI does without ``-f``).

    Memory: about two pieces plus metadata for safetensors and ``torch.save``
    checkpoints (mapped, paged out as read); DCP adds the tensor being written.

    Raises:
        CheckpointMismatchError: missing, extra, mis-typed, mis-shaped or
            mis-ordered keys, delegates, unknown tags: all listed at once, by
            key; nothing written.
        FormatError: the program or a ``like`` file is invalid, or the checkpoint
            cannot be read (a DCP folder without ``format="dcp"`` included).
        FileNotFoundError: ``out_dir`` does not exist.
        OverwriteError: a file to write is one of the files read (the program,
            a ``like`` file, a file of ``checkpoint`` or ``old_checkpoint``; same
            device and inode, links included), naming both, or (``force=False``)
            exists, naming it; nothing written.
        ValueError: ``segment_alignment <= 0`` (upstream's text).
        ArgumentTypeError: a ``progress`` outside the contract (nothing read).
        IntegrityError, OSError: a read or write failed (nothing published).
    """
    start = time.perf_counter()
    out_dir = _check_arguments(out_dir, progress, segment_alignment)
    with _opened(checkpoint, format, old_checkpoint, old_format) as (ckpt, old):
        weights = program if isinstance(program, ProgramWeights) else read_program_weights(program)
        plan, nkeys, changed = plan_ptd_files(weights, ckpt, out_dir, like=like, tag=tag, key_map=key_map,
                                              allow_extra=allow_extra, segment_alignment=segment_alignment,
                                              old_checkpoint=old, keep=keep)
        _refuse_overwriting(plan, [weights.path, *like], (ckpt, old), force)
        written = time.perf_counter()
        reports = _write(plan, progress, chunk_nbytes, window_nbytes)
        write_seconds = time.perf_counter() - written
    return _report(reports, plan, nkeys, changed, time.perf_counter() - start, write_seconds)


def _check_arguments(out_dir, progress: Any, segment_alignment: int) -> str:
    """Step 1 of :func:`write_ptd`, before any file is opened: the ``progress``
    contract, the alignment (upstream's text) and the output folder; returns
    ``out_dir`` as a str.

    Raises:
        ArgumentTypeError, ValueError, FileNotFoundError: as :func:`write_ptd`.
    """
    from ..format.layout import check_alignment
    from ..progress import check_progress

    check_progress(progress)
    check_alignment(segment_alignment, "segment_alignment")  # before a checkpoint is opened
    out_dir = os.fspath(out_dir)
    if not os.path.isdir(out_dir):
        raise FileNotFoundError(f"{out_dir}: output folder does not exist")
    return out_dir


@contextlib.contextmanager
def _opened(checkpoint: str | Checkpoint, format: str, old_checkpoint: None | str | Checkpoint,
            old_format: str) -> Iterator[tuple[Checkpoint, Checkpoint | None]]:
    """Step 2 of :func:`write_ptd`: ``(checkpoint, old_checkpoint)`` open (a path
    opened with its format, an open :class:`Checkpoint` as it is); what this
    opened is closed on leaving, on any exit (a failed second open included)."""
    with contextlib.ExitStack() as stack:
        def open_(given: str | Checkpoint, how: str) -> Checkpoint:
            if isinstance(given, Checkpoint):
                return given
            opened = open_checkpoint(given, how)
            stack.callback(opened.close)
            return opened

        ckpt = open_(checkpoint, format)
        yield ckpt, None if old_checkpoint is None else open_(old_checkpoint, old_format)


def _refuse_overwriting(plan, files: Sequence[str], checkpoints: Sequence[Checkpoint | None], force: bool) -> None:
    """Step 5 of :func:`write_ptd`: refuse, before anything is written, an output
    that is one of the inputs (``files``: the program and the ``like`` files; every
    file of ``checkpoints``) or, unless ``force``, that exists
    (:func:`~ptdstream.system.files.refuse_overwrite`)."""
    from ..system.files import refuse_overwrite

    inputs = [*files, *(path for c in checkpoints if c is not None for path in c.files())]
    refuse_overwrite(inputs, [f.path for f in plan.files], force=force)


def _write(plan, progress: Any, chunk_nbytes: int, window_nbytes: int) -> list:
    """Step 6 of :func:`write_ptd`: every file of ``plan`` written to a temp file,
    synced and published as a set (:func:`~ptdstream.write.set_writer.write_save_plan`),
    with a progress bar or callback over its bytes; the ``FileReport`` of each."""
    from ..progress import progress_callback
    from ..write.set_writer import write_save_plan

    with contextlib.ExitStack() as stack:
        callback = progress_callback(stack, progress, plan.nbytes, f"writing {len(plan.files)} .ptd file(s)")
        return write_save_plan(plan, chunk_nbytes=chunk_nbytes, window_nbytes=window_nbytes, progress=callback)


def _report(reports: Sequence, plan, nkeys: int, changed: tuple[str, ...], seconds: float,
            write_seconds: float) -> WeightsReport:
    """Step 7 of :func:`write_ptd`: the :class:`WeightsReport` of what was written
    (``seconds``: the call; ``write_seconds``: step 6, the span of ``gbps``)."""
    nbytes = sum(r.nbytes for r in reports)
    return WeightsReport(tuple(reports), nbytes, seconds, nbytes / max(write_seconds, 1e-9) / 1e9,
                         plan.dedup_saved_nbytes, nkeys, changed, write_seconds)
