"""An engine-style demo backend (TensorRT-like) whose engines never exist as Python bytes.

``EngineBackend.preprocess`` "builds an engine" for its partition: it streams
the partition's weights into a file in ``engine_dir`` (``tensor.numpy().tofile``,
no ``bytes`` object), fsyncs it, and hands it to the named data store as
executorch's ``FileBackedData`` under ``engine:<sha256>`` in the external tag
``engines``. Methods whose partitions build the same engine therefore name the
same key with the same data, and it is stored once (upstream ``NamedDataStore``
semantics). The processed blob is just the key.

``ptdstream.save`` then streams each engine from its file into ``engines.ptd``
(read once, pages dropped after each piece); upstream's own serializer writes
the same bytes.

Usage::

    partitioner = EnginePartitioner(engine_dir="/tmp/engines")
    edge = to_edge_transform_and_lower({"forward": ep1, "prefill": ep2}, partitioner=[partitioner])
    manager = edge.to_executorch()
    ptdstream.save(manager, "out/model.pte")   # out/engines.ptd holds each engine once
"""

from __future__ import annotations

import hashlib
import os
from typing import final

import torch
from executorch.exir._serialize._cord import FileBackedData
from executorch.exir._serialize._named_data_store import NamedDataStore
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.canonical_partitioners.pattern_op_partitioner import (
    generate_pattern_op_partitions,
)
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.backend.utils import tag_constant_data
from torch.export.exported_program import ExportedProgram
from torch.fx.passes.operator_support import OperatorSupportBase

ENGINE_TAG = "engines"


def _build_engine(edge_program: ExportedProgram, engine_dir: str) -> tuple:
    """Write the partition's weights, in name order, to a new engine file.

    Returns ``(path, sha256 digest)``; the digest is computed from the tensors
    while they are written, so the file is never read back for it.
    """
    os.makedirs(engine_dir, exist_ok=True)
    digest = hashlib.sha256()
    tensors = dict(edge_program.state_dict)
    tensors.update(getattr(edge_program, "constants", {}) or {})
    tmp = os.path.join(engine_dir, f".engine-{os.getpid()}-{id(edge_program)}.tmp")
    with open(tmp, "wb") as f:
        for name in sorted(tensors):
            t = tensors[name]
            if not isinstance(t, torch.Tensor):
                continue
            array = t.detach().contiguous().cpu().view(torch.uint8).numpy()
            digest.update(array)
            array.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    path = os.path.join(engine_dir, f"{digest.hexdigest()}.engine")
    os.replace(tmp, path)
    return path, digest.digest()


@final
class EngineBackend(BackendDetails):
    """Builds one engine file per partition; hands it over as file-backed named data."""

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        specs = {s.key: s.value for s in compile_specs}
        engine_dir = specs["engine_dir"].decode()
        path, sha = _build_engine(edge_program, engine_dir)
        key = f"engine:{sha.hex()}"
        store = NamedDataStore()
        store.add_named_data(key, FileBackedData(path, sha256=sha), alignment=64, external_tag=ENGINE_TAG)
        return PreprocessResult(
            processed_bytes=key.encode(),
            debug_handle_map={},
            data_store_output=store.get_named_data_store_output(),
        )


@final
class BlobEngineBackend(BackendDetails):
    """Builds one engine file per partition and hands the engine itself over as
    the delegate blob (``PreprocessResult.processed_bytes``), still in its file:
    :func:`ptdstream.file_blob`. Lower and emit inside
    :func:`ptdstream.delegate_blobs_from_files`."""

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        from ptdstream import file_blob

        specs = {s.key: s.value for s in compile_specs}
        path, sha = _build_engine(edge_program, specs["engine_dir"].decode())
        return PreprocessResult(processed_bytes=file_blob(path, sha256=sha), debug_handle_map={})


class _AllCallFunctions(OperatorSupportBase):
    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        return node.op == "call_function"


@final
class EnginePartitioner(Partitioner):
    """Hands every operator (and the constants they use) to :class:`EngineBackend`
    (``engine_as_blob=True``: to :class:`BlobEngineBackend`)."""

    def __init__(self, engine_dir: str, engine_as_blob: bool = False) -> None:
        self.engine_dir = engine_dir
        backend = BlobEngineBackend if engine_as_blob else EngineBackend
        self.delegation_spec = DelegationSpec(
            backend.__name__, [CompileSpec("engine_dir", engine_dir.encode())]
        )

    def partition(self, edge_program: ExportedProgram) -> PartitionResult:
        tags: dict[str, DelegationSpec] = {}
        for partition in generate_pattern_op_partitions(
            edge_program.graph_module, op_support=_AllCallFunctions()
        ):
            tag = f"engine_{partition.id or 0}"
            for node in partition.nodes:
                node.meta["delegation_tag"] = tag
            tags[tag] = self.delegation_spec
        tag_constant_data(edge_program)
        return PartitionResult(tagged_exported_program=edge_program, partition_tags=tags)
