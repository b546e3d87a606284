"""Which layout parameters a manager was built with.

executorch 1.5.1's ``ExecutorchProgramManager`` does not keep the
``ExecutorchBackendConfig`` it was built with, yet ``save(manager, path)`` must
reproduce its segment, constant-tensor and delegate alignment and its delegate
extraction. In order of preference:

1. an explicit ``config`` (an ``ExecutorchBackendConfig`` or
   :class:`~ptdstream.format.pte.PteOptions`);
2. the config recorded on the manager when it was built, once
   :func:`ptdstream.install` (or ``hooks.install.record_backend_configs``) is active;
3. the parameters read back from the manager's own serialized output: the .ptd
   segment alignment is kept by its ``FlatTensorSerializer``; the rest is found by
   planning the metadata head (a few KiB; no payload is touched) for candidate
   values and keeping the first whose head equals the manager's byte for byte.
   Equal heads imply equal files, since the head holds every offset.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..errors import LayoutError
from ..format.identity import HEADER_OFFSET, ExtendedHeader
from ..format.layout import pack_subsegments
from ..format.pte import PteOptions
from ..upstream import adapter
from ..upstream.adapter import ManagerParts
from .serialize import plan_program

__all__ = ["resolve_options"]

_POWERS = [1 << i for i in range(0, 15)]


def _as_options(config: Any) -> PteOptions:
    if isinstance(config, PteOptions):
        return config
    return PteOptions.from_backend_config(config)


def resolve_options(manager, config: Any = None, parts: ManagerParts | None = None) -> PteOptions:
    """The :class:`PteOptions` to save ``manager`` with (see the module docstring).

    Raises:
        LayoutError: no explicit or recorded config, and no candidate reproduces
            the manager's metadata head ("pass config=...").
    """
    if config is not None:
        return _as_options(config)
    found, recorded = adapter.recorded_backend_config(manager)
    if found:
        return _as_options(recorded)
    return infer_options(manager, parts)


def infer_options(manager, parts: ManagerParts | None = None) -> PteOptions:
    """Read the layout parameters back from the manager's serialized metadata head."""
    parts = parts or adapter.manager_parts(manager)
    reference = parts.pte_head
    for options in _candidates(parts):
        plan = plan_program(parts, options, "probe.pte")
        head = plan.extents[0].data
        if head is not None and head[: len(reference)] == reference and len(head) >= len(reference):
            return options
    raise LayoutError(
        "could not read the layout parameters back from the manager's output; "
        "pass config=<the ExecutorchBackendConfig given to to_executorch()> to save()"
    )


def _candidates(parts: ManagerParts) -> Iterator[PteOptions]:
    segment_alignment = parts.ptd_segment_alignment
    program = parts.program
    head = parts.pte_head
    eh = ExtendedHeader.from_bytes(head[HEADER_OFFSET:])
    extract_choices = [True, False]
    tensor_choices: list[int | None] = [None]
    if eh is not None:
        try:
            parsed = adapter.flatbuffer_to_program(head[: eh.program_size])
        except Exception:  # noqa: BLE001 - a probe only; fall back to the full search
            parsed = None
        if parsed is not None:
            tensor_choices = _tensor_alignment_choices(program, parsed)
    else:
        tensor_choices = [None] + [p for p in _POWERS if p != 16]
    delegate_choices: list[int | None] = [None] + [p for p in _POWERS if p != 16]
    seen = set()
    for extract in extract_choices:
        for cta in tensor_choices:
            for da in delegate_choices:
                options = PteOptions(extract, segment_alignment, cta, da)
                if options not in seen:
                    seen.add(options)
                    yield options


def _tensor_alignment_choices(program, parsed) -> list[int | None]:
    sizes = [len(b.storage) for b in program.constant_buffer]
    offsets = list(getattr(parsed.constant_segment, "offsets", None) or [])
    if not sizes or len(offsets) != len(sizes):
        return [None] + [p for p in _POWERS if p != 16]
    fits = [p for p in _POWERS if list(pack_subsegments(sizes, p)[0]) == offsets]
    ordered: list[int | None] = [None] if 16 in fits else []
    return ordered + [p for p in fits if p != 16]
