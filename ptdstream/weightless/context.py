"""``weights_from(checkpoint)``: export, lower, emit and save while no weight is held.

The route: an export script, unchanged, inside one ``with`` line (portable with
external constants, ``ExecutorchBackendConfig(external_constants=True)``)::

    with ptdstream.weights_from("model.safetensors"):
        with torch.device("meta"):
            model = MyModel(config)                           # no weight allocated
        program = torch.export.export(model, example_inputs)  # storage-less parameters
        manager = to_edge(program).to_executorch(ExecutorchBackendConfig(external_constants=True))
        ptdstream.save(manager, "out/model.pte")              # or upstream's write_to_file

1) ``torch.export`` inside the block makes the module's meta parameters and
meta persistent buffers storage-less cpu tensors first
(:mod:`ptdstream.weightless.lowering`; :meth:`WeightsFrom.model` does the same
for a factory or a meta module, :mod:`ptdstream.weightless.storage_less`) and
traces it (no parameter is cloned: there are no bytes); 2) as the program
reaches lowering (``run_decompositions``, where ``to_edge`` and
``to_edge_transform_and_lower`` begin; emission binds any left) each
storage-less constant is bound by FQN to the checkpoint's memory-mapped
tensor, after checking them all (:mod:`ptdstream.weightless.binding`; every
problem at once); :meth:`WeightsFrom.bind` (or :meth:`WeightsFrom.export`) does
it at once, for errors before lowering and ``key_map``s per program: binding is
idempotent; 3) ``to_edge`` and ``to_executorch`` run as usual; inside the context the emitter keeps each
constant as a reference to the mapped tensor
(:func:`ptdstream.hooks.emitter.constants_by_reference`: its SHA-256, and so
upstream's dedup classes, streamed from the checkpoint in pieces, pages paged
out), and a program that still holds a storage-less constant is refused by
name before emission (so no manager, and nothing written, ever holds one);
4) ``ptdstream.save`` streams each weight from the checkpoint through its ring.

XNNPACK with weights tagged to a ``.ptd`` (``delegate_external_constants_pass_unlifted``
on ``program.module()``, re-exported, bound as it is lowered) works the same way: inside the
context XNNPACK keeps unchanged weights by reference and its per-partition copy
shares the bound tensors (:mod:`ptdstream.weightless.delegates`).

A checkpoint tensor stored in another float dtype than the export's (float32,
float16, bfloat16, to one another), and every tensor of a DCP checkpoint (loaded,
not mapped), is bound to a copy: converted piece by piece into a temporary file
of ``convert_dir`` and mapped back (:mod:`ptdstream.weightless.convert`), made
when the program is bound, after every check passed, once per key; each file is removed once
mapped (the mapping keeps it), what is left when the context exits (also after
an exception) too.

The checkpoint's files must not change from when the context opens them until
the save: each file's identity (:class:`~ptdstream.sources.base.FileIdentity`)
is taken when the context opens and checked when a tensor is converted (before
and after), before and after emission (``to_executorch`` refuses, naming the keys bound
from a changed file: nothing emitted, nothing written) and, for converted keys,
when the context exits normally (``IntegrityError``; a file saved in the block
then holds the values the checkpoint had when they were converted). While the
context is open, the save checks the file's identity at every read of a mapped
tensor (:func:`~ptdstream.sources.mapped.expecting_files`), and the bytes against
the emitter's digest. These checks apply whatever thread emits or saves (a
``ThreadPoolExecutor`` hand-off inside the block): emission checks every open
context that bound a tensor of the program.

What needs the weights' values while exporting: ``constant_prop_pass`` run
before :meth:`WeightsFrom.bind` leaves folded constants that
:meth:`~WeightsFrom.bind` refuses by name; run after it (directly, or by
``to_executorch`` with ``do_quant_fusion_and_const_prop=True``), it computes them
from the mapped checkpoint, each moved to a nameless temp file as soon as it is
computed (:mod:`ptdstream.weightless.folding`: one folded constant in memory at
a time, the same bytes). Quantization (torchao's ``quantize_``, optimum's
``qlinear`` / ``qembedding``) of storage-less weights runs as the weights
stream: each weight read from the checkpoint, converted, quantized by
torchao's handler on its module, its quantized tensors moved to nameless files
and bound to its key at lowering (``quantized_keys``); a config not covered is
refused by name before anything is read
(:mod:`ptdstream.weightless.quantization`); XNNPACK's packing of
transformed weights (4-bit, NHWC or swapped convolutions) reads them from the
mapping and copies them, as upstream does. Checkpoints: safetensors (a file,
or a Hugging Face sharded folder), weights-only ``torch.save`` (both mapped) and
DCP (``format="dcp"``, converted: one tensor loaded at a time).

executorch's CUDA backend (AOTI compiles with the weights on the GPU): its
per-method copies share the bound weights and each bound constant it moves to
the GPU is loaded straight from the checkpoint file, once, through the pinned
ring (:mod:`ptdstream.weightless.to_device`: no host copy, no page of the
mapping touched, the file checked unchanged); lower inside
:func:`~ptdstream.stream_cuda_weights` and ``ptdstream.save`` streams them from the GPU.

Patches: ``torch.export``'s and ``run_decompositions`` (:mod:`~ptdstream.weightless.lowering`),
the emitter's (see ``constants_by_reference``), XNNPACK's (see
``xnnpack_constants_by_reference`` and :mod:`~ptdstream.weightless.delegates`),
``constant_prop_pass``'s (:mod:`~ptdstream.weightless.folding`), torchao's
walk of ``quantize_`` (:mod:`~ptdstream.weightless.quantization`), the CUDA backend's
(:mod:`~ptdstream.weightless.to_device`, when it is importable) and executorch's
``exir/program/_program.py`` module global ``emit_program`` (a check of its
input first: :mod:`~ptdstream.weightless.emission`), all scoped through :mod:`ptdstream.upstream.patching`; all but
the emission check are restored when the last context exits. The emission
check stays from the first context on, for the process (it refuses only what
upstream's emitter cannot emit: storage-less constants, by name), so a model
that outlives its block is refused by name, not by upstream's ``NULL pointer
access``. Contexts nest and may be open in several threads at once (each with
its own checkpoint); ``torch.export`` itself is not thread-safe, so the caller
runs export and lowering (``to_edge``, ``to_executorch``) one thread at a time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..errors import IntegrityError, StateError
from ..hooks.emitter import constants_by_reference
from ..hooks.fx_sources import releasing_generated_sources
from ..sources.base import FileIdentity
from ..sources.checkpoint import open_checkpoint
from ..sources.checkpoint_base import Checkpoint
from ..sources.mapped import expecting_files
from ..system.pagecache import release_shared_under
from ..upstream import adapter
from ..upstream.patching import Scope, shadowed
from .binding import bind_programs, plan_binding
from .buffers import move_large_buffers
from .convert import ConvertDir, RowReader
from .delegates import add_bound, bound_weights, sharing_bound_weights
from .emission import checking_emit
from .folding import folded_to_files
from .lowering import binding_at_lowering, fix_heap
from .lowering import opened as opened_in_thread
from .quantization import streaming_quantization
from .quantized_storages import QuantizedStorages
from .storage_less import storage_less_model
from .to_device import DeviceLoads, loading_bound_to_device

__all__ = ["WeightsFrom", "weights_from"]

#: Checkpoint kinds whose tensors are memory-mapped views (bound without a read).
MAPPED_KINDS = ("safetensors", "torch")

#: open from the first weights_from on, for the process: a model made by WeightsFrom.model that outlives its
#: block still has its storage-less constants refused by name at emission (upstream reads no bytes from them)
_emission_checked = Scope()


def _identity(path: str) -> FileIdentity | None:
    try:
        return FileIdentity.of(os.stat(path))
    except FileNotFoundError:
        return None


class WeightsFrom:
    """What :func:`weights_from` yields: the checkpoint, and the three steps
    :meth:`model`, :meth:`bind` (or :meth:`export`, both at once).

    ``convert_dir`` (a :class:`~ptdstream.weightless.convert.ConvertDir`) holds
    the converted copies; ``bound_keys`` and ``converted_keys`` list the
    checkpoint keys bound so far and those bound to a converted copy.
    Valid only inside its ``with`` block (``StateError`` after).
    """

    def __init__(self, checkpoint: Checkpoint, key_map: Mapping[str, str] | None, allow_extra: bool,
                 convert_dir: ConvertDir) -> None:
        self.checkpoint = checkpoint
        self.key_map = dict(key_map or {})
        self.allow_extra = allow_extra
        self.convert_dir = convert_dir
        self._open = True
        self._bound: list[Any] = []  # every tensor bound (kept alive: XNNPACK's copy shares them by id)
        #: each checkpoint file -> its identity when the context opened it
        self._identities = {f: _identity(f) for f in checkpoint.files()}
        self.bound_keys: list[str] = []  #: checkpoint keys bound, in binding order
        self.converted_keys: list[str] = []  #: those bound to a converted copy
        self._quantized = QuantizedStorages()  # the quantized tensors made in the block, by storage
        self.quantized_keys: list[str] = self._quantized.keys  #: checkpoint keys read and quantized by quantize_
        self._refused: set[str] = set()  # changed files already refused
        #: the bound tensors the CUDA backend loads straight from the checkpoint to the GPU, and its stats
        self.device_loads = DeviceLoads(checkpoint, self._identities)
        #: bind by FQN the storage-less constants no context recorded (False: only those :meth:`record` named)
        self.by_name = True
        self.programs_bound = 0  #: programs (or sets of methods) that bind changed
        self._origins: dict[int, str] = {}  # id(recorded or bound tensor) -> checkpoint key
        self._kept: list[Any] = []  # the recorded tensors, alive so their ids stay theirs
        self._tensors: dict[str, Any] = {}  # checkpoint key -> its bound tensor (mapped, or a converted copy)
        self._made: dict[tuple[str, bool], Any] = {}  # (key, requires_grad) -> the Parameter bound
        self._moved: dict[int, Any] = {}  # address -> a buffer storage moved to a file (weightless.buffers)

    def _files_of(self, key: str) -> list[str]:
        parts = self.checkpoint.derived.get(key)
        if parts is not None:  # a fused key: the files of its parts
            return list(dict.fromkeys(f for k, _, _ in parts for f in self._files_of(k)))
        where = self.checkpoint.entries[key].where
        return [where] if where in self._identities else list(self._identities)

    def check_unchanged(self, keys: list[str], when: str, again: bool = True) -> None:
        """Refuse a change of a checkpoint file that ``keys`` come from since the
        context opened it (``again=False``: not a change this refused before).

        Raises:
            IntegrityError: names the file, both identities, the keys and ``when``.
        """
        files = {f: None for key in keys for f in self._files_of(key)}
        changed = [f for f in files if _identity(f) != self._identities[f] and (again or f not in self._refused)]
        if changed:
            self._refused.update(changed)
            file = changed[0]
            names = [key for key in keys if file in self._files_of(key)]
            raise IntegrityError(
                f"checkpoint file {file}: changed after weights_from opened it (device, inode, size, modification "
                f"and change time {tuple(self._identities[file] or ())} then, {tuple(_identity(file) or ())} now), "
                f"{when}: {len(names)} bound key(s) come from it: {', '.join(repr(k) for k in names[:20])}"
                + (f" (and {len(changed) - 1} more changed file(s): {', '.join(changed[1:4])})"
                   if len(changed) > 1 else "")
                + "; a checkpoint must not change until the save: export again from an unchanged checkpoint")

    def _check_open(self, what: str) -> None:
        if not self._open:
            raise StateError(f"{self.checkpoint.path}: weights_from(...).{what}() called after its with block "
                             "ended: call it inside the block")

    def model(self, factory_or_module: Callable[[], Any] | Any) -> Any:
        """A model with storage-less parameters, from a factory or a meta-device
        module: see :func:`ptdstream.weightless.storage_less.storage_less_model`."""
        self._check_open("model")
        return storage_less_model(factory_or_module)

    def bind(self, programs: Any, key_map: Mapping[str, str] | None = None) -> Any:
        """Bind every storage-less constant of ``programs`` (an ``ExportedProgram``
        or ``{method: ExportedProgram}``, changed in place and returned) to the
        checkpoint's tensor of its FQN (through the context's ``key_map``, then
        this call's ``key_map``, which wins for the FQNs it names; a tensor
        :meth:`record` named takes its recorded key where no ``key_map`` names its FQN).

        Checks everything first: nothing is converted or bound if anything is
        wrong. Then converts what the plan converts (another float dtype, or a
        DCP checkpoint), then binds. Idempotent: constants this context bound
        already count as bound (a program bound at lowering needs no call).

        Raises:
            BindingError: every missing key, extra key, dtype that is not
                converted, wrong shape or dim order, at once.
            IntegrityError: a checkpoint file changed since the context opened
                it, before or while a key was converted (names file and key).
            OSError: a converted copy could not be written (names ``convert_dir``).
        """
        self._check_open("bind")
        return self._bind(programs, key_map, self.allow_extra)

    def bind_found(self, programs: Mapping[str, Any]) -> None:
        """:meth:`bind` as a program reaches lowering or emission
        (:mod:`ptdstream.weightless.lowering`): checkpoint keys it does not use
        are not extra (its other methods or models may be lowered later)."""
        self._check_open("bind")
        self._bind(programs, None, True)

    def _bind(self, programs: Any, key_map: Mapping[str, str] | None, allow_extra: bool) -> Any:
        methods = programs if isinstance(programs, Mapping) else {"forward": programs}
        self.adopt_quantized(methods)
        plan = plan_binding(methods, self.checkpoint, {**self.key_map, **(key_map or {})}, allow_extra,
                            self._origins)
        if not plan.groups:
            return programs
        mapped = self.checkpoint.kind in MAPPED_KINDS
        new = [key for key in plan.groups if key not in self._tensors]
        converted = self._convert({key: plan.converted.get(key, self.checkpoint.entries[key].dtype) for key in new
                                   if not mapped or key in plan.converted or key in self.checkpoint.derived})
        for key in new:
            self._tensors[key] = converted[key] if key in converted else self.checkpoint.tensor(key)
        placed = bind_programs(methods, self.checkpoint, plan, self._tensors.__getitem__, self._made)
        add_bound(self._bound, [t for tensors in placed.values() for t in tensors])
        for key, tensors in placed.items():
            for tensor in tensors:
                self._origins[id(tensor)] = key  # kept alive by _bound: the id stays this tensor's
        for key in new:
            self.device_loads.add(key, self._tensors[key])
        self.bound_keys.extend(new)
        self.converted_keys.extend(converted)
        self.programs_bound += 1
        return programs

    def record(self, tensor: Any, key: str) -> None:
        """Bind ``tensor`` (a storage-less tensor, kept alive) to checkpoint key
        ``key`` wherever a program holds it, whatever its FQN there, unless a
        ``key_map`` names that FQN; this context then binds it at lowering even
        when an inner context binds by name."""
        if id(tensor) not in self._origins:
            self._kept.append(tensor)
        self._origins[id(tensor)] = key

    def key_of(self, tensor: Any) -> str | None:
        """The checkpoint key :meth:`record` named for ``tensor`` (or this context bound it to), or None."""
        return self._origins.get(id(tensor))

    @contextlib.contextmanager
    def reading(self, key: str, dtype: Any) -> Iterator[RowReader]:
        """Rows of checkpoint tensor ``key`` read in ``dtype`` (the model's), for
        quantization (:mod:`ptdstream.weightless.quantization`): from the mapped
        checkpoint, or (DCP, a fused key) from a converted copy made first.

        Raises:
            IntegrityError, OSError: as :meth:`bind`, for the converted copy.
        """
        mapped = self.checkpoint.kind in MAPPED_KINDS and key not in self.checkpoint.derived
        tensor = self.checkpoint.tensor(key) if mapped else self._convert({key: dtype})[key]
        reader = RowReader(tensor, dtype, f"key {key!r}")
        try:
            yield reader
        finally:
            reader.close()

    def note_quantized(self, key: str, weight: Any) -> None:
        """``weight`` (a torchao quantized tensor) was made from checkpoint key
        ``key``: a program tensor sharing one of its inner tensors' storages is
        bound to ``key`` (:meth:`adopt_quantized`), the key checked unchanged as
        bound keys are (:class:`~ptdstream.weightless.quantized_storages.QuantizedStorages`)."""
        add_bound(self._bound, self._quantized.note(key, weight))

    def move_large_buffers(self, module: Any) -> None:
        """Move ``module``'s large buffers (the static KV cache) to files of this
        context's folder, in place (:func:`~ptdstream.weightless.buffers.move_large_buffers`)."""
        for storage in move_large_buffers(module, self.convert_dir.folder):
            self._moved[storage.data_ptr()] = storage

    def holds_file_tensor(self, tensor: Any) -> bool:
        """Whether plain tensor ``tensor`` lies in a file this context wrote: a
        quantized tensor's (:meth:`note_quantized`) or a moved buffer's storage."""
        if tensor.untyped_storage().data_ptr() in self._moved:
            return True
        return self._quantized.key_of(tensor) is not None

    def release_file_pages(self) -> None:
        """Unmap from this process the pages read of the files this context wrote
        to its folder (quantized weights, converted copies, folded constants,
        XNNPACK's packed weights: shared mappings of nameless files), the page cache
        keeping them: their RSS goes, their bytes stay
        (:func:`~ptdstream.system.pagecache.release_shared_under`)."""
        release_shared_under(self.convert_dir.folder)

    def adopt_quantized(self, programs: Mapping[str, Any]) -> None:
        """Each constant of ``programs`` that shares the storage of a tensor
        :meth:`note_quantized` recorded (``unwrap_tensor_subclass``'s parameters)
        counts as bound to its key: registered as bound (XNNPACK's copy shares
        it) and recorded, so binding takes it as bound and its key as used."""
        add_bound(self._bound, self._quantized.adopt(programs, self._origins))

    def owns(self, tensor: Any) -> bool:
        """Whether :meth:`record` named ``tensor``'s key (or this context bound it)."""
        return id(tensor) in self._origins

    def _convert(self, dtypes: Mapping[str, Any]) -> dict[str, Any]:
        """Each key's converted copy (``dtypes``: key -> the export's dtype); a
        failed call leaves no file (each conversion removes its own) and binds nothing."""
        out: dict[str, Any] = {}
        for key, dtype in dtypes.items():
            entry = self.checkpoint.entries[key]
            self.check_unchanged([key], f"before key {key!r} was converted")
            out[key] = self.convert_dir.convert(
                self.checkpoint.source(key), entry.dtype, dtype, entry.shape, entry.dim_order,
                f"{entry.where}: key {key!r} ({entry.dtype} -> {dtype})")
            self.check_unchanged([key], f"while key {key!r} was converted")
        return out

    def export(self, model: Any, args: tuple, **kwargs: Any) -> Any:
        """``bind(torch.export.export(model, args, **kwargs))``."""
        import torch

        self._check_open("export")
        return self.bind(torch.export.export(model, args, **kwargs))


@contextlib.contextmanager
def weights_from(checkpoint: str | os.PathLike[str], key_map: Mapping[str, str] | None = None, *,
                 format: str = "auto", allow_extra: bool = False,
                 convert_dir: str | os.PathLike[str] | None = None) -> Iterator[WeightsFrom]:
    """Export with storage-less parameters, bound at the end to ``checkpoint``'s tensors.

    ``checkpoint``: a ``.safetensors`` file, a Hugging Face folder or index, a
    weights-only ``torch.save`` file, or (``format="dcp"``) a DCP folder
    (:func:`ptdstream.sources.checkpoint.open_checkpoint`, ``format`` as there).
    ``key_map``: ``{fqn: checkpoint key}`` for names that differ.
    ``allow_extra``: ignore checkpoint keys no constant uses. ``convert_dir``:
    the folder converted copies are written to (tensors stored in another
    float dtype, every DCP tensor; files 0600, each removed once mapped back);
    default: a new temporary folder, removed at exit.
    Host memory: the checkpoint's metadata and, while saving, the ring; weights
    are read in pieces from the mapping (or the converted copy) and paged out;
    a DCP tensor is loaded whole while it is converted, one at a time. For the
    rest of the process, glibc gives blocks of 256 KiB and more their own
    mapping (:func:`ptdstream.system.heap.fix_mmap_threshold`: what tracing
    frees goes back to the system). See the
    module docstring for the whole route and what it refuses.

    Raises:
        FormatError: a checkpoint that cannot be read.
        CheckpointFileError: a shard the folder's index names that is missing,
            unreadable or outside the folder (names the index, shard and keys).
        FileNotFoundError: nothing at ``checkpoint``.
        NotADirectoryError: ``convert_dir`` is not an existing folder.
        IntegrityError: at exit, a checkpoint file that converted keys come from
            changed since the context opened it (not raised over another error).
    """
    opened = open_checkpoint(os.fspath(checkpoint), format)
    fix_heap()
    with opened:
        module = adapter.program_module()
        convert = ConvertDir(convert_dir)
        weights: WeightsFrom | None = None
        try:
            _emission_checked.open(lambda: shadowed(module, "emit_program", checking_emit(module.emit_program)))
            weights = WeightsFrom(opened, key_map, allow_extra, convert)
            with opened_in_thread(weights), expecting_files(weights._identities.items()), binding_at_lowering(), \
                    bound_weights(weights._bound), constants_by_reference(), sharing_bound_weights(convert.folder), \
                    folded_to_files(weights._bound, convert.folder), streaming_quantization(), \
                    loading_bound_to_device(weights.device_loads), releasing_generated_sources():
                yield weights
            weights.check_unchanged(list(dict.fromkeys(weights.converted_keys + weights.quantized_keys)),
                                    "before weights_from exited (its converted copies and quantized weights hold "
                                    "the values from before the change)", again=False)
        finally:
            if weights is not None:
                weights._open = False
            convert.close()
