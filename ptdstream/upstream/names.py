"""The registry of every private executorch and torch name ptdstream relies on.

Checked against executorch 1.5.1 (:data:`CHECKED_VERSIONS`). Code outside
:mod:`ptdstream.upstream` reaches none of these names: it calls the accessors
of :mod:`ptdstream.upstream.adapter`, which resolve them through
:func:`resolve` (an unregistered name raises ``KeyError``). Every entry of
:data:`NAMES` must import and every :data:`FIELDS` entry must exist on real
objects of each checked release; one a release renames or removes fails by
name. Supporting a newer executorch release starts here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["CHECKED_VERSIONS", "FIELDS", "NAMES", "resolve"]

#: executorch releases the names below were checked against.
CHECKED_VERSIONS = ("1.5.1",)


@dataclass(frozen=True)
class PrivateName:
    """A private module-level name: ``module`` imported, then ``attribute`` (dotted,
    ``""`` for the module itself) looked up; ``use`` says what ptdstream does with it."""

    module: str
    attribute: str
    use: str

    def resolve(self) -> Any:
        """Import and return the object.

        Raises:
            ImportError: the module is gone (or its package is not installed).
            AttributeError: the attribute is gone.
        """
        obj: Any = importlib.import_module(self.module)
        for part in filter(None, self.attribute.split(".")):
            obj = getattr(obj, part)
        return obj


@dataclass(frozen=True)
class PrivateField:
    """A private instance attribute ptdstream reads or sets on executorch objects."""

    owner: str
    field: str
    use: str


_SER = "executorch.exir._serialize"
_FB = f"{_SER}._flatbuffer_program"
_COLLECTOR = "executorch.backends.cuda.cuda_weight_collector"

NAMES: tuple[PrivateName, ...] = (
    PrivateName(f"{_SER}._cord", "FileBackedData", "data that lives in a file; ptdstream subclasses it"),
    PrivateName(f"{_SER}._cord", "Cord", "the manager's serialized output, streamed by verify"),
    PrivateName(_FB, "_program_to_flatbuffer", "the Python-builder .pte flatbuffer (flatc gives other bytes)"),
    PrivateName(_FB, "_flatbuffer_to_program", "parse the manager's own metadata head (trusted input)"),
    PrivateName(f"{_SER}._serialize", "_extract_external_tensor_layouts", "layouts of emitter constants in a .ptd"),
    PrivateName("executorch.extension.flat_tensor.serialize.serialize", "_serialize_to_flatbuffer",
                "the FlatTensor flatbuffer (JSON through the bundled flatc)"),
    PrivateName("executorch.exir.emit._emitter", "", "module globals 'bytes' and 'hashlib' shadowed by emitter.py"),
    PrivateName("executorch.exir.emit._emitter", "_Emitter", "the emitter class whose method emitter.py wraps"),
    PrivateName("executorch.exir.emit._emitter", "_Emitter._tensor_spec_to_evalue",
                "copies a constant with the module's only bytes() call"),
    PrivateName("executorch.exir.emit._emitter", "_Emitter._emit_delegate", "hashes and keeps processed_bytes"),
    PrivateName("torch._export.verifier", "", "module global 'bytes' shadowed by blobs.py"),
    PrivateName("executorch.backends.xnnpack.operators.node_visitor", "",
                "module globals 'bytes', 'hashlib' and 'get_param_tensor' shadowed by xnnpack.py"),
    PrivateName("executorch.backends.xnnpack.operators.node_visitor", "NodeVisitor.get_serialized_buffer_index",
                "copies each XNNPACK constant with bytes() into the NamedDataStore"),
    PrivateName("executorch.backends.xnnpack.operators.node_visitor", "NodeVisitor", "XNNPACK's node visitor class"),
    PrivateName("executorch.backends.xnnpack.operators.node_visitor", "NodeVisitor.convert_to_qc4w",
                "packs a 4-bit weight whole; shadowed by xnnpack_qc4w.py (bands into a file)"),
    PrivateName(_COLLECTOR, "", "executorch's CUDA backend weight collector (cuda_backend.py)"),
    PrivateName(_COLLECTOR, "_write_tensor_storage", "replaced: copies one AOTI storage to a file, returns SHA-256"),
    PrivateName(_COLLECTOR, "FileBackedData", "replaced: move_from(path, sha256) turns that file into named data"),
    PrivateName(_COLLECTOR, "trim_host_memory", "replaced: gc.collect + malloc_trim around each method"),
    PrivateName("executorch.backends.cuda.cuda_backend", "CudaBackend", "executorch's CUDA backend (AOTI)"),
    PrivateName("executorch.backends.cuda.cuda_backend", "CudaBackend.copy_exported_program_for_preprocess",
                "replaced: the per-method deepcopy made before any method compiles (hooks/cuda/sharing.py)"),
    PrivateName("executorch.backends.cuda.cuda_backend", "CudaBackend.release_moved_tensors",
                "replaced: frees every CUDA storage of a compiled method's program (shared weights kept)"),
    PrivateName("executorch.backends.cuda.cuda_backend", "CudaBackend.move_program_to_device",
                "wrapped by weightless: bound checkpoint weights loaded from their file to the GPU first"),
    PrivateName("torch.fx.passes.infra.partitioner", "",
                "module global '_DependencyViewer' shadowed by reachability.py"),
    PrivateName("torch.fx.passes.infra.partitioner", "_DependencyViewer",
                "CapabilityBasedPartitioner's per-node closure sets (quadratic memory)"),
    PrivateName("executorch.exir.backend.canonical_partitioners.group_partitioner", "",
                "module global '_DependencyViewer' shadowed by reachability.py"),
    PrivateName("executorch.exir.backend.canonical_partitioners.group_partitioner", "_DependencyViewer",
                "GroupBasedPartitioner's (XNNPACK's) per-node closure sets, both directions (quadratic memory)"),
    PrivateName("torch.fx.graph_module", "",
                "module global '_method_from_src' shadowed by fx_sources.py"),
    PrivateName("torch.fx.graph_module", "_method_from_src", "compiles a graph's method; its source kept forever"),
    PrivateName("torch.fx.graph_module", "_loader.eval_cache", "every generated source, by <eval_with_key>.N name"),
    PrivateName("torch._dynamo.functional_export", "",
                "its globals keep each export capture's graph (__compiled_fn_*): program_caches.py drops them"),
    PrivateName("executorch.exir.backend.utils", "is_same_node",
                "lru_cache over node pairs, never cleared; program_caches.py empties it"),
    PrivateName("executorch.backends.xnnpack.partition.config.xnnpack_config", "why",
                "WhyNoPartition keeping the last refused node; program_caches.py drops the node"),
    PrivateName("torch._subclasses.fake_tensor", "FakeTensor", "storage-less parameters (weightless export)"),
    PrivateName("torchao.quantization.transform_module", "_QUANTIZE_CONFIG_HANDLER",
                "torchao's handler of each config (quantizes one module's weight): weights_from runs it per weight"),
    PrivateName("torchao.quantization.quant_api", "", "module whose walk global weights_from shadows"),
    PrivateName("torchao.quantization.quant_api", "_replace_with_custom_fn_if_matches_filter",
                "module global: the walk every quantize_ makes; shadowed by weights_from to stream each weight"),
    PrivateName("torch._subclasses.fake_tensor", "FakeTensorMode", "makes storage-less cpu tensors"),
    PrivateName("torch.utils._python_dispatch", "is_traceable_wrapper_subclass",
                "finds quantized tensor subclasses made from storage-less weights (weightless)"),
    PrivateName("executorch.exir.program._program", "",
                "module global 'emit_program' shadowed by weightless (unbound constants refused by name)"),
    PrivateName("executorch.exir.passes.constant_prop_pass", "",
                "module global 'get_constant_placeholder_dict' shadowed by weightless (folded constants to files)"),
    PrivateName("executorch.exir.passes.constant_prop_pass", "get_propagated_const_tensor_dict",
                "computes each folded constant; run under weightless's transposing mode (transposes in bands)"),
    PrivateName("torch.utils._python_dispatch", "TorchDispatchMode",
                "weightless: a bound weight's folded transpose written to a file in bands"),
    PrivateName("torch.export._trace", "", "module global '_export' (torch.export.export's, looked up when called) "
                "shadowed by weightless (meta parameters made storage-less first)"),
    PrivateName("torch.export._trace", "_export", "traces torch.export.export's module (wrapped by weightless)"),
    PrivateName("torch._dynamo.variables.builder", "",
                "module global '_clone_input' shadowed by weightless while it exports (quantized weights not cloned)"),
    PrivateName("torch._dynamo.variables.builder", "_clone_input",
                "copies each real tensor a strict torch.export traces into its real-value cache"),
    PrivateName("torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor", "",
                "module global '_choose_qparams_and_quantize_scale_only_hqq' shadowed by weightless "
                "(a large weight's HQQ in bands: the whole tensor's stop found first)"),
    PrivateName("torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor",
                "_choose_qparams_and_quantize_scale_only_hqq",
                "the HQQ scale-only function IntxUnpackedToInt8Tensor.from_hp calls (wrapped by weightless)"),
    PrivateName("torchao.quantization.quant_primitives", "_choose_qparams_and_quantize_scale_only_hqq",
                "torchao's HQQ scale-only (its iters and early_stop_tol defaults read by weightless)"),
    PrivateName("torch._C", "_storage_Use_Count",
                "how many tensors share a storage: weightless moves a large buffer to a file only when it "
                "re-points every one of them"),
    PrivateName("transformers.core_model_loading", "convert_and_load_state_dict_in_model",
                "from_pretrained's key renaming and fusing, run by weightless on stand-ins (transformers 5.0.0rc1)"),
    PrivateName("transformers.conversion_mapping", "get_model_conversion_mapping",
                "a model's weight conversion mapping, as from_pretrained computes it (transformers 5.0.0rc1)"),
    PrivateName("transformers.modeling_utils", "PreTrainedModel._load_pretrained_model",
                "from_pretrained's one weight-reading step, replaced by weightless.hf (transformers 5.0.0rc1)"),
)

FIELDS: tuple[PrivateField, ...] = (
    PrivateField("executorch.exir.ExecutorchProgramManager", "_emitter_output",
                 "program, mutable data, external constants"),
    PrivateField("executorch.exir.ExecutorchProgramManager", "_named_data", "the backends' NamedDataStoreOutput"),
    PrivateField("executorch.exir.ExecutorchProgramManager", "_data_serializer", "the FlatTensorSerializer's config"),
    PrivateField("executorch.exir.ExecutorchProgramManager", "_pte_data", "the .pte Cord (reference for verify)"),
    PrivateField("executorch.exir.ExecutorchProgramManager", "_tensor_data", "{tag: Cord} (reference for verify)"),
    PrivateField(f"{_SER}._cord.Cord", "_buffers", "the Cord's pieces (bytes or FileBackedData)"),
    PrivateField(f"{_SER}._cord.FileBackedData", "_path", "set by ptdstream's FileBackedData subclasses"),
    PrivateField(f"{_SER}._cord.FileBackedData", "_size", "set by ptdstream's FileBackedData subclasses"),
    PrivateField(f"{_SER}._cord.FileBackedData", "_sha256", "set by ptdstream's FileBackedData subclasses"),
    PrivateField(f"{_SER}._cord.FileBackedData", "_finalizer", "set by ptdstream's FileBackedData subclasses"),
)

_BY_KEY: dict[tuple[str, str], PrivateName] = {(n.module, n.attribute): n for n in NAMES}


def resolve(module: str, attribute: str = "") -> Any:
    """The registered private name ``module`` + ``attribute``, imported.

    Raises:
        KeyError: the name is not in :data:`NAMES` (register it first).
        ImportError, AttributeError: it is registered but gone from this release.
    """
    return _BY_KEY[(module, attribute)].resolve()
