"""Which files a manager's save writes, and what each holds: the mirror of upstream's
``exir/_serialize/_serialize.py::serialize_for_executorch`` (executorch 1.5.1).

* the .pte holds the backends' ``pte_data`` named data when there is any;
* with no emitter external constants, each tag of the backends' store becomes
  ``<tag>.ptd`` as it is;
* otherwise a fresh store takes the emitter's constants first (alignment 1,
  layouts from the program), then merges the backends' store, and each of its
  tags becomes a .ptd (a tag whose keys were all already present elsewhere
  still gets its, empty, file: upstream does the same).

Payload is never copied: buffers become sources.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..format.plan import DataEntry, FilePlan
from ..format.pte import PteOptions, plan_pte
from ..sources import Source, as_source
from ..sources.fingerprint import Fingerprint
from ..store import StreamingNamedDataStore
from ..upstream import adapter
from ..upstream.adapter import ManagerParts

__all__ = ["data_files", "plan_program"]


@dataclass(frozen=True)
class DataFiles:
    """The data files of a manager's save, before planning: the buffers (sources),
    ``{tag: {key: DataEntry}}`` in upstream's tag order, and the digests already
    known per buffer index."""

    buffers: Sequence[Source]
    external_data: Mapping[str, Mapping[str, DataEntry]]
    fingerprints: Mapping[int, Fingerprint]


def buffer_sources(buffers: Sequence[Any]) -> list[Source]:
    """A store output's buffers as sources (labelled by index; nothing copied)."""
    return [as_source(b, label=f"buffer {i}").hand_over() for i, b in enumerate(buffers)]


def plan_program(parts: ManagerParts, options: PteOptions, name: str) -> FilePlan:
    """Plan the manager's .pte from its parts."""
    named = parts.named_data
    buffers: list[Source] = []
    pte_data = None
    if named is not None and len(named.buffers) > 0 and len(named.pte_data) > 0:
        buffers = buffer_sources(named.buffers)
        pte_data = named.pte_data
    return plan_pte(
        parts.program,
        mutable_data=parts.mutable_data,
        named_buffers=buffers,
        named_data=pte_data,
        options=options,
        name=name,
    )


def data_files(parts: ManagerParts, store: StreamingNamedDataStore) -> DataFiles | None:
    """The manager's data files as upstream would serialize them; None when there
    are none. Emitter constants are added to ``store`` (it counts the dedup)."""
    named = parts.named_data
    constant_map = parts.external_constant_map
    if len(constant_map) == 0:
        if named is None or len(named.external_data) == 0:
            return None
        return DataFiles(buffer_sources(named.buffers), dict(named.external_data), {})
    layouts = adapter.external_tensor_layouts(parts.program)
    constants = parts.external_constant_buffer
    sources: dict[int, Source] = {}
    for tag, fqn_to_index in constant_map.items():
        for fqn, index in fqn_to_index.items():
            if index not in sources:
                sources[index] = as_source(constants[index], label=f"constant {fqn!r}")
            store.add_named_data(fqn, sources[index], tensor_layout=layouts[fqn], external_tag=tag)
    if named is not None:
        store.merge_named_data_store(named)
    out = store.get_named_data_store_output()
    return DataFiles(out.buffers, out.external_data, out.fingerprints)
