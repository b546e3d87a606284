"""From an ``ExecutorchProgramManager`` to a :class:`~ptdstream.format.plan.SavePlan`.

``serialize`` mirrors upstream's ``serialize_for_executorch`` (which files, holding
what); ``options`` finds the layout parameters the manager was built with;
:func:`plan_manager` puts them together. Nothing is written.
"""

from __future__ import annotations

import os
from typing import Any

from ..format.plan import FileRole, PlannedFile, SavePlan
from ..format.ptd import plan_data_files
from ..sources.base import BufferRing
from ..store import StreamingNamedDataStore
from ..upstream import adapter
from .options import resolve_options
from .serialize import data_files, plan_program

__all__ = ["plan_manager"]


def plan_manager(
    manager,
    path: str,
    *,
    config: Any = None,
    data_dir: str | None = None,
    ring: BufferRing | None = None,
) -> SavePlan:
    """Plan every file ``save`` would write, without writing anything.

    Args:
        manager: an ``ExecutorchProgramManager``.
        path: the .pte path; must end with ``.pte``.
        config: ``ExecutorchBackendConfig`` or ``PteOptions``; by default the
            recorded or inferred one (:mod:`ptdstream.manager.options`).
        data_dir: folder of the .ptd files (default: the .pte's folder).
        ring: buffers for digesting dedup candidates (one 8 MiB piece by default).

    Raises:
        ValueError: ``path`` does not end with ``.pte`` (upstream's check), or
            upstream's store errors (duplicate key with different data).
        LayoutError: a bad external tag, or parameters that cannot be resolved.
    """
    path = os.fspath(path)
    if not path.endswith(".pte"):
        raise ValueError(f"Path {path} does not end with .pte")
    parts = adapter.manager_parts(manager)
    options = resolve_options(manager, config, parts)
    folder = data_dir if data_dir is not None else (os.path.dirname(path) or ".")
    store = StreamingNamedDataStore(ring)
    found = data_files(parts, store)
    planned_data: tuple[PlannedFile, ...] = ()
    if found is not None:
        planned_data = plan_data_files(found.buffers, found.external_data, folder,
                                       segment_alignment=parts.ptd_segment_alignment,
                                       fingerprints=found.fingerprints)
    program = PlannedFile(path, FileRole.PROGRAM, plan_program(parts, options, os.path.basename(path)))
    return SavePlan(planned_data, program, options, store.dedup_saved_nbytes)
