"""The door to executorch's internals: every private name, behind one accessor each.

Names are resolved through :mod:`ptdstream.upstream.names` (the registry the
tests check against each release); patches go through
:mod:`ptdstream.upstream.patching`. Public executorch API (``exir.schema``,
``TensorLayout``, ``ExecutorchProgramManager``) may be imported where it is used.
This module imports nothing of ptdstream but the registry: every other layer may
import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .names import CHECKED_VERSIONS, resolve

__all__ = [
    "CHECKED_VERSIONS",
    "CUDA_COLLECTOR_PATCHED",
    "FILE_BACKED_FIELDS",
    "RECORDED_CONFIG_ATTR",
    "ManagerParts",
    "backend_config_argument",
    "cached_sha256",
    "cord_items",
    "cuda_backend",
    "cuda_weight_collector",
    "emitter_class",
    "emitter_module",
    "convert_and_load_state_dict",
    "export_trace_module",
    "export_verifier_module",
    "external_tensor_layouts",
    "fake_tensor_mode",
    "fake_tensor_type",
    "fx_graph_module_module",
    "dispatch_mode_type",
    "dynamo_capture_module",
    "file_backed_data_type",
    "file_backed_path",
    "flat_tensor_to_flatbuffer",
    "flatbuffer_to_program",
    "hqq_scale_only_function",
    "init_file_backed",
    "intx_unpacked_module",
    "manager_class",
    "manager_parts",
    "model_conversion_mapping",
    "partitioner_modules",
    "preload_serializer",
    "pretrained_model_class",
    "program_module",
    "program_to_flatbuffer",
    "recorded_backend_config",
    "same_node_cache",
    "reference_cords",
    "set_cached_sha256",
    "storage_use_count",
    "tensor_spec_fqn",
    "tensor_spec_storage",
    "xnnpack_node_visitor_module",
    "xnnpack_qc4w_packer",
    "xnnpack_refusal_log",
]

_CORD = "executorch.exir._serialize._cord"
_FB = "executorch.exir._serialize._flatbuffer_program"
_COLLECTOR = "executorch.backends.cuda.cuda_weight_collector"

#: ``FileBackedData``'s private fields that ptdstream's subclasses set themselves
#: (they have no file to stat): path (or None), size in bytes, SHA-256 (or None,
#: computed lazily) and the finalizer that would remove a temp file (None).
FILE_BACKED_FIELDS = ("_path", "_size", "_sha256", "_finalizer")


# ------------------------------------------------------------------ builders


def program_to_flatbuffer(program, constant_tensor_alignment, delegate_alignment) -> tuple[bytes, int]:
    """Upstream's Python-builder flatbuffer for a ``Program`` and its max alignment.

    ``exir/_serialize/_flatbuffer_program.py::_program_to_flatbuffer``: the exact
    builder ``serialize_pte_binary`` uses (flatc gives other bytes).
    """
    result = resolve(_FB, "_program_to_flatbuffer")(
        program,
        constant_tensor_alignment=constant_tensor_alignment,
        delegate_alignment=delegate_alignment,
    )
    return bytes(result.data), result.max_alignment


def flat_tensor_to_flatbuffer(flat_tensor) -> bytes:
    """Upstream's FlatTensor flatbuffer (JSON through the bundled flatc).

    ``extension/flat_tensor/serialize/serialize.py::_serialize_to_flatbuffer``.
    """
    fn = resolve("executorch.extension.flat_tensor.serialize.serialize", "_serialize_to_flatbuffer")
    return bytes(fn(flat_tensor))


def flatbuffer_to_program(data: bytes):
    """Parse a trusted program flatbuffer into ``executorch.exir.schema.Program``
    (the manager's own output; untrusted files are read by :mod:`ptdstream.format`)."""
    return resolve(_FB, "_flatbuffer_to_program")(data)


def external_tensor_layouts(program) -> dict[str, Any]:
    """``{fqn: TensorLayout}`` of the program's external tensors, as upstream
    computes them for the emitter's constants
    (``exir/_serialize/_serialize.py::_extract_external_tensor_layouts``)."""
    return resolve("executorch.exir._serialize._serialize", "_extract_external_tensor_layouts")(program)


# ------------------------------------------------------------------ FileBackedData


def file_backed_data_type() -> type[Any]:
    """executorch's ``FileBackedData`` (``exir/_serialize/_cord.py``)."""
    return resolve(_CORD, "FileBackedData")


def file_backed_path(data: Any) -> str | None:
    """The path behind an executorch ``FileBackedData`` (private ``_path``), else None.

    ptdstream's own subclasses without a file return None.
    """
    try:
        cls = file_backed_data_type()
    except ImportError:  # pragma: no cover - executorch is a dependency
        return None
    if isinstance(data, cls):
        return data._path
    return None


def init_file_backed(obj: Any, path: str | None, nbytes: int, sha256: bytes | None = None) -> None:
    """Set the private fields of a ``FileBackedData`` subclass instance that does not
    call ``FileBackedData.__init__`` (no file to stat): see :data:`FILE_BACKED_FIELDS`."""
    obj._path, obj._size, obj._sha256, obj._finalizer = path, nbytes, sha256, None


def cached_sha256(obj: Any) -> bytes | None:
    """A ``FileBackedData``'s cached SHA-256 (None until computed)."""
    return obj._sha256


def set_cached_sha256(obj: Any, digest: bytes | None) -> None:
    """Record a ``FileBackedData``'s SHA-256 (32 bytes) so it is not computed again."""
    obj._sha256 = digest


def cord_items(cord) -> Sequence[Any]:
    """The pieces of an executorch ``Cord``, in order: bytes-likes and ``FileBackedData``."""
    return cord._buffers


# ------------------------------------------------------------------ the manager


@dataclass(frozen=True)
class ManagerParts:
    """What a save needs from an ``ExecutorchProgramManager`` (its private fields).

    Attributes:
        program: the emitter's ``executorch.exir.schema.Program``, constants inline.
        mutable_data: the emitter's ``List[Buffer]`` of mutable data, or None.
        external_constant_buffer: the emitter's external constants (bytes-likes).
        external_constant_map: ``{tag: {fqn: index into external_constant_buffer}}``.
        named_data: the backends' ``NamedDataStoreOutput``, or None.
        ptd_segment_alignment: bytes; the manager's ``FlatTensorSerializer``'s.
        pte_head: the bytes before the first segment of the manager's own
            serialized .pte (its metadata head; used to read layout parameters back).
    """

    program: Any
    mutable_data: list[Any] | None
    external_constant_buffer: list[Any]
    external_constant_map: dict[str, dict[str, int]]
    named_data: Any
    ptd_segment_alignment: int
    pte_head: bytes


def manager_parts(manager) -> ManagerParts:
    """The :class:`ManagerParts` of an ``ExecutorchProgramManager`` (no payload copied)."""
    emitter = manager._emitter_output
    items = cord_items(manager._pte_data)
    head = items[0] if items else b""
    return ManagerParts(
        program=emitter.program,
        mutable_data=emitter.mutable_data,
        external_constant_buffer=emitter.external_constant_buffer or [],
        external_constant_map=emitter.external_constant_map or {},
        named_data=manager._named_data,
        ptd_segment_alignment=manager._data_serializer.config.segment_alignment,
        pte_head=head if isinstance(head, bytes) else bytes(head),
    )


def reference_cords(manager) -> tuple[Any, dict[str, Any]]:
    """The manager's own serialized output: the .pte ``Cord`` and ``{tag: Cord}``."""
    return manager._pte_data, dict(manager._tensor_data or {})


#: The attribute :func:`ptdstream.install` records a manager's config under.
RECORDED_CONFIG_ATTR = "_ptdstream_backend_config"


def recorded_backend_config(manager) -> tuple[bool, Any]:
    """``(True, config)`` when the manager was built while configs were recorded
    (``config`` is an ``ExecutorchBackendConfig``; a manager built with none gets
    the default one), else ``(False, None)``."""
    if not hasattr(manager, RECORDED_CONFIG_ATTR):
        return False, None
    config = getattr(manager, RECORDED_CONFIG_ATTR)
    if config is None:
        from executorch.exir import ExecutorchBackendConfig

        config = ExecutorchBackendConfig()
    return True, config


def manager_class() -> type[Any]:
    """``executorch.exir.ExecutorchProgramManager``."""
    from executorch.exir import ExecutorchProgramManager

    return ExecutorchProgramManager


def backend_config_argument(init, args: tuple, kwargs: dict) -> Any:
    """The ``backend_config`` a call ``ExecutorchProgramManager.__init__(*args, **kwargs)``
    passes (None when not given), bound by the real signature."""
    import inspect

    bound = inspect.signature(init).bind(*args, **kwargs)
    return bound.arguments.get("backend_config")


# ------------------------------------------------------------------ patched modules


def emitter_module():
    """executorch's emitter module (``exir/emit/_emitter.py``)."""
    return resolve("executorch.exir.emit._emitter")


def emitter_class():
    """``exir/emit/_emitter.py::_Emitter``."""
    return resolve("executorch.exir.emit._emitter", "_Emitter")


def tensor_spec_storage(spec) -> Any:
    """The ``torch.UntypedStorage`` of an emitter ``TensorSpec`` (None if unset)."""
    return getattr(spec, "storage", None)


def tensor_spec_fqn(spec) -> str | None:
    """The fully qualified name the emitter knows for ``spec`` (None if unknown)."""
    return getattr(getattr(spec, "extra_tensor_info", None), "fully_qualified_name", None)


def xnnpack_node_visitor_module():
    """XNNPACK's node visitor module (``backends/xnnpack/operators/node_visitor.py``):
    ``NodeVisitor.get_serialized_buffer_index`` copies each constant with ``bytes``."""
    return resolve("executorch.backends.xnnpack.operators.node_visitor")


def xnnpack_qc4w_packer() -> tuple[Any, Any]:
    """``(NodeVisitor, its convert_to_qc4w function)``: XNNPACK's packing of a 4-bit
    weight (``backends/xnnpack/operators/node_visitor.py``, a staticmethod), whole."""
    visitor = resolve("executorch.backends.xnnpack.operators.node_visitor", "NodeVisitor")
    resolve("executorch.backends.xnnpack.operators.node_visitor", "NodeVisitor.convert_to_qc4w")
    return visitor, vars(visitor)["convert_to_qc4w"].__func__


def fx_graph_module_module():
    """torch's ``torch/fx/graph_module.py``: its ``_method_from_src`` compiles each
    recompiled ``forward``, its ``_loader.eval_cache`` keeps every source."""
    for attribute in ("_method_from_src", "_loader.eval_cache"):
        resolve("torch.fx.graph_module", attribute)
    return resolve("torch.fx.graph_module")


def _installed(module: str, attribute: str = "") -> Any:
    """:func:`resolve`, or None when the package is not installed (an optional one)."""
    try:
        return resolve(module, attribute)
    except ImportError:
        return None


def dynamo_capture_module() -> Any:
    """dynamo's export capture (``torch/_dynamo/functional_export.py``), whose module
    globals receive each captured graph as ``__compiled_fn_*``; None when it is not importable."""
    return _installed("torch._dynamo.functional_export")


def same_node_cache() -> Any:
    """executorch's ``is_same_node`` (``exir/backend/utils.py``, an ``lru_cache``);
    None when executorch is not installed."""
    return _installed("executorch.exir.backend.utils", "is_same_node")


def xnnpack_refusal_log() -> Any:
    """XNNPACK's ``WhyNoPartition`` (``backends/xnnpack/partition/config/xnnpack_config.py``:
    ``why``, its ``node`` the last one refused); None when XNNPACK is not installed."""
    return _installed("executorch.backends.xnnpack.partition.config.xnnpack_config", "why")


def partitioner_modules() -> tuple[Any, ...]:
    """The modules whose global ``_DependencyViewer`` the partitioners build:
    torch's ``torch/fx/passes/infra/partitioner.py`` and executorch's
    ``exir/backend/canonical_partitioners/group_partitioner.py``."""
    for module in _PARTITIONER_MODULES:
        resolve(module, "_DependencyViewer")
    return tuple(resolve(module) for module in _PARTITIONER_MODULES)


_PARTITIONER_MODULES = ("torch.fx.passes.infra.partitioner",
                        "executorch.exir.backend.canonical_partitioners.group_partitioner")


def export_verifier_module():
    """torch's export verifier module (``torch/_export/verifier.py``)."""
    return resolve("torch._export.verifier")


#: Names of ``executorch.backends.cuda.cuda_weight_collector`` that
#: :func:`ptdstream.hooks.cuda.backend.stream_cuda_weights` replaces while
#: active (see :data:`ptdstream.upstream.names.NAMES`).
CUDA_COLLECTOR_PATCHED = ("_write_tensor_storage", "FileBackedData", "trim_host_memory")


def cuda_weight_collector():
    """executorch's CUDA backend weight collector module (``backends/cuda/cuda_weight_collector.py``).

    Raises:
        ImportError: executorch's CUDA backend is not importable.
    """
    return resolve(_COLLECTOR)


def cuda_backend() -> type[Any]:
    """executorch's ``CudaBackend`` class (``backends/cuda/cuda_backend.py``), whose
    ``copy_exported_program_for_preprocess`` and ``release_moved_tensors``
    :mod:`ptdstream.hooks.cuda.sharing` replaces, and whose ``move_program_to_device``
    :mod:`ptdstream.weightless.to_device` wraps.

    Raises:
        ImportError: executorch's CUDA backend is not importable (it needs triton).
    """
    for name in ("copy_exported_program_for_preprocess", "release_moved_tensors", "move_program_to_device"):
        resolve("executorch.backends.cuda.cuda_backend", f"CudaBackend.{name}")
    return resolve("executorch.backends.cuda.cuda_backend", "CudaBackend")


def fake_tensor_type() -> type:
    """``torch._subclasses.fake_tensor.FakeTensor``: a tensor with metadata and no storage."""
    return resolve("torch._subclasses.fake_tensor", "FakeTensor")


def dispatch_mode_type() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: a context that sees each aten call."""
    return resolve("torch.utils._python_dispatch", "TorchDispatchMode")


def fake_tensor_mode(**kwargs: Any) -> Any:
    """A new ``torch._subclasses.fake_tensor.FakeTensorMode(**kwargs)``."""
    return resolve("torch._subclasses.fake_tensor", "FakeTensorMode")(**kwargs)


def is_traceable_wrapper_subclass(tensor: Any) -> bool:
    """``torch.utils._python_dispatch.is_traceable_wrapper_subclass``: a tensor
    subclass made of inner tensors (``__tensor_flatten__``), such as torchao's quantized tensors."""
    return bool(resolve("torch.utils._python_dispatch", "is_traceable_wrapper_subclass")(tensor))


def quantize_handler(config: Any) -> Any:
    """torchao's handler of ``type(config)`` (``torchao/quantization/transform_module.py``'s
    ``_QUANTIZE_CONFIG_HANDLER``, what ``quantize_`` calls on each module it picks):
    ``handler(module, config)`` quantizes ``module.weight`` in place and returns the module.

    Raises:
        KeyError: torchao has no handler for that config type.
    """
    return resolve("torchao.quantization.transform_module", "_QUANTIZE_CONFIG_HANDLER")[type(config)]


def torchao_quant_api() -> Any:
    """torchao's ``torchao/quantization/quant_api.py``, whose module global
    ``_replace_with_custom_fn_if_matches_filter`` (the walk ``quantize_`` makes
    with a config, looked up when called) weights_from shadows.

    Raises:
        ImportError: torchao is not installed.
    """
    api = resolve("torchao.quantization.quant_api")
    resolve("torchao.quantization.quant_api", "_replace_with_custom_fn_if_matches_filter")
    return api


def program_module():
    """executorch's program module (``exir/program/_program.py``): ``ExecutorchProgramManager``
    calls its module global ``emit_program`` to emit the edge programs."""
    return resolve("executorch.exir.program._program")


def export_trace_module():
    """torch's export tracing module (``torch/export/_trace.py``): ``torch.export.export``
    imports its module global ``_export`` when called, and calls it with the module to trace."""
    resolve("torch.export._trace", "_export")
    return resolve("torch.export._trace")


def dynamo_builder_module():
    """dynamo's tensor wrapping module (``torch/_dynamo/variables/builder.py``): in a
    strict ``torch.export`` it copies each real tensor it wraps (a parameter
    included) with its module global ``_clone_input``, looked up when called, into
    the tracer's real-value cache (read only for values a trace branches on)."""
    resolve("torch._dynamo.variables.builder", "_clone_input")
    return resolve("torch._dynamo.variables.builder")


def intx_unpacked_module() -> Any:
    """torchao's ``IntxUnpackedToInt8Tensor`` module
    (``torchao/quantization/quantize_/workflows/intx/intx_unpacked_to_int8_tensor.py``):
    ``from_hp`` calls its module global ``_choose_qparams_and_quantize_scale_only_hqq``
    (looked up when called) under the ``hqq_scale_only`` algorithm.

    Raises:
        ImportError: torchao is not installed.
    """
    name = "torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor"
    resolve(name, "_choose_qparams_and_quantize_scale_only_hqq")
    return resolve(name)


def hqq_scale_only_function() -> Any:
    """torchao's HQQ scale-only (``quant_primitives.py``): its ``iters`` and
    ``early_stop_tol`` defaults are the ones ``from_hp`` runs with."""
    return resolve("torchao.quantization.quant_primitives", "_choose_qparams_and_quantize_scale_only_hqq")


def storage_use_count(storage: Any) -> int:
    """How many references hold ``storage`` (a ``torch.UntypedStorage``; the
    wrapper passed counts one): each tensor over it, each storage wrapper."""
    return int(resolve("torch._C", "_storage_Use_Count")(storage._cdata))


def constant_prop_module():
    """executorch's constant propagation module (``exir/passes/constant_prop_pass.py``):
    ``get_propagated_const_tensor_dict`` fills the dict its module global
    ``get_constant_placeholder_dict`` returns with every folded tensor."""
    return resolve("executorch.exir.passes.constant_prop_pass")


def pretrained_model_class() -> type:
    """``transformers.PreTrainedModel``, once its ``_load_pretrained_model`` (the
    step of ``from_pretrained`` that reads the weights) is found where expected."""
    import transformers

    resolve("transformers.modeling_utils", "PreTrainedModel._load_pretrained_model")
    return transformers.PreTrainedModel


def convert_and_load_state_dict(model: Any, state_dict: dict[str, Any], weight_mapping: list[Any],
                                dtype: Any = None, dtype_plan: Any = None) -> tuple:
    """``transformers.core_model_loading.convert_and_load_state_dict_in_model`` as
    ``PreTrainedModel._load_pretrained_model`` calls it for a CPU load (no tensor
    parallelism, quantizer, device map or offload): renames and converts
    ``state_dict``'s tensors by ``weight_mapping`` and sets them on ``model``.
    Returns transformers' ``(missing, unexpected, mismatched, offload index, conversion errors)``."""
    convert = resolve("transformers.core_model_loading", "convert_and_load_state_dict_in_model")
    return tuple(convert(model, state_dict, weight_mapping, None, None, dtype, None, dtype_plan, None, None, None))


def model_conversion_mapping(model: Any) -> list[Any]:
    """``transformers.conversion_mapping.get_model_conversion_mapping(model)``: the
    renamings and conversions ``from_pretrained`` applies to ``model``'s checkpoint."""
    return list(resolve("transformers.conversion_mapping", "get_model_conversion_mapping")(model))


def preload_serializer() -> None:
    """Import torch and executorch's serializer (slow, noisy imports) now."""
    resolve(_FB, "_program_to_flatbuffer")
