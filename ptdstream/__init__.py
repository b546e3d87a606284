"""ptdstream: write ExecuTorch .pte/.ptd artifacts as a stream, byte-identical to
ExecuTorch's own serializer, in bounded host memory.

The ways in, each by its public path:

* ``ptdstream.save(manager, "model.pte")``: drop-in for ``write_to_file`` +
  ``write_tensor_data_to_file``; ``ptdstream.install()`` (or ``installed()``)
  routes executorch's own save methods through it; ``ptdstream.recover(folder)``
  completes a set a killed save left half published;
* the ``ptdstream`` command (``verify``, ``inspect``, ``manifest``, ``pack``,
  ``unpack``, ``extract``, ``weights``, ``recover``, ``demo``);
* ``ptdstream.write_ptd(program, checkpoint, out_dir)``: a program's ``.ptd``
  files from a checkpoint (:mod:`ptdstream.weights`); ``ptdstream.weights_from(checkpoint)``:
  export, lower, emit and save on storage-less parameters bound to the checkpoint
  (:mod:`ptdstream.weightless`);
  ``ptdstream.distributed.write_data_files``: one ``.ptd`` set written by every
  rank of a ``torch.distributed`` group;
* inside upstream's export: :func:`constants_by_reference`,
  :func:`xnnpack_constants_by_reference`, :func:`stream_cuda_weights` (the CUDA
  backend), :func:`file_blob` and :func:`delegate_blobs_from_files` (delegate
  blobs kept in files), :class:`SourceBackedData`; ``ptdstream.hf.export``
  (optimum-executorch, needs ``ptdstream[hf]``);
* the embedding API: :class:`StreamingNamedDataStore`, sources,
  :func:`write_data_files`, :func:`plan_pte`, :func:`plan_ptd`,
  :class:`ChunkedFileSink`, :func:`write_plan`;
* the built-in example: ``ptdstream.demo.model.build_tiny_lm()``, the model
  ``ptdstream demo`` exports (the docs' examples use its weights).

Everything else is reached through these; deeper modules are the
implementation (the package map is in docs/ARCHITECTURE.md). Names load on
first use, so ``import ptdstream`` imports neither torch nor executorch.
"""

# First: in the ptdstream command, Ctrl-C from here on is one line and exit 130
# (ptdstream._entry). Other programs (sys.argv[0] neither "-m", as while
# ``python -m`` imports the package, nor a ``ptdstream`` script) skip even the import.
import sys as _sys

if _sys.argv and (_sys.argv[0] == "-m" or _sys.argv[0].rpartition("/")[2].lower().startswith("ptdstream")):
    from ._entry import guard_startup as _guard_startup

    _guard_startup()

import importlib

from .errors import (
    ArgumentTypeError,
    CheckpointFileError,
    CheckpointMismatchError,
    FlatbufferError,
    FormatError,
    IntegrityError,
    LayoutError,
    MissingKeyError,
    OverwriteError,
    PtdstreamError,
    RecoveryError,
    StateError,
)
from .save import DataFilesReport, SaveReport, save, write_data_files

#: Public names loaded on first use (``import ptdstream`` stays fast): name -> module.
_LAZY = {
    "BufferRing": "sources", "FileRangeSource": "sources", "MemorySource": "sources", "Source": "sources",
    "TensorSource": "sources", "as_source": "sources", "Fingerprint": "sources.fingerprint",
    "FilePlan": "format.plan", "SavePlan": "format.plan", "plan_ptd": "format.ptd", "PteOptions": "format.pte",
    "plan_pte": "format.pte", "plan_manager": "manager", "StreamingNamedDataStore": "store",
    "ChunkedFileSink": "write.sink", "write_plan": "write.writer", "prepare_folders": "write.publish",
    "check_structure": "check.structure",
    "recover": "write.journal",
    "write_ptd": "weights", "WeightsReport": "weights", "weights_from": "weightless",
    "SourceBackedData": "hooks.interop", "file_blob": "hooks.blobs", "delegate_blobs_from_files": "hooks.blobs",
    "xnnpack_constants_by_reference": "hooks.xnnpack", "stream_cuda_weights": "hooks.cuda.backend",
    # the ways in's own errors (each in its ``errors`` module)
    "DistributedWriteError": "distributed.errors", "DistributedIntegrityError": "distributed.errors",
    "BindingError": "weightless.errors", "MetaBufferError": "weightless.errors",
    "NeedsWeightValuesError": "weightless.errors", "QuantizationNeedsValuesError": "weightless.errors",
    "QuantizationShapeError": "weightless.errors", "UnboundConstantError": "weightless.errors",
}


#: Public submodules loaded on first use: ``ptdstream.distributed``, ``ptdstream.weights``,
#: ``ptdstream.hf``, ``ptdstream.weightless``, ``ptdstream.demo`` (the built-in example).
_LAZY_MODULES = ("demo", "distributed", "hf", "weights", "weightless")


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ptdstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES))


__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "BindingError",
    "BufferRing",
    "CheckpointFileError",
    "CheckpointMismatchError",
    "ChunkedFileSink",
    "DataFilesReport",
    "DistributedIntegrityError",
    "DistributedWriteError",
    "FilePlan",
    "FileRangeSource",
    "Fingerprint",
    "FlatbufferError",
    "FormatError",
    "IntegrityError",
    "LayoutError",
    "MemorySource",
    "MetaBufferError",
    "MissingKeyError",
    "NeedsWeightValuesError",
    "OverwriteError",
    "PtdstreamError",
    "PteOptions",
    "QuantizationNeedsValuesError",
    "QuantizationShapeError",
    "RecoveryError",
    "SavePlan",
    "SaveReport",
    "Source",
    "SourceBackedData",
    "StateError",
    "StreamingNamedDataStore",
    "TensorSource",
    "UnboundConstantError",
    "WeightsReport",
    "as_source",
    "check_structure",
    "constants_by_reference",
    "delegate_blobs_from_files",
    "demo",
    "distributed",
    "file_blob",
    "hf",
    "install",
    "installed",
    "plan_manager",
    "plan_ptd",
    "plan_pte",
    "prepare_folders",
    "recover",
    "save",
    "stream_cuda_weights",
    "uninstall",
    "weightless",
    "weights",
    "weights_from",
    "write_data_files",
    "write_plan",
    "write_ptd",
    "xnnpack_constants_by_reference",
]


def install() -> None:
    """Route executorch's save paths through ptdstream and record configs, until
    :func:`uninstall`. See :mod:`ptdstream.hooks.install`."""
    from .hooks.install import install as _install

    _install()


def uninstall() -> None:
    """Undo :func:`install` (executorch's own methods are restored)."""
    from .hooks.install import uninstall as _uninstall

    _uninstall()


def installed():
    """Context manager: :func:`install` inside, restored on exit."""
    from .hooks.install import installed as _installed

    return _installed()


def constants_by_reference():
    """Context manager: executorch's emitter keeps constants as references to their
    tensors, not ``bytes`` copies (wrap ``to_executorch()``).

    See :func:`ptdstream.hooks.emitter.constants_by_reference`.
    """
    from .hooks.emitter import constants_by_reference as _constants_by_reference

    return _constants_by_reference()
