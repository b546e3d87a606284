"""Plan a .ptd (FlatTensor): buffers + ``{key: DataEntry}`` -> :class:`~ptdstream.format.plan.FilePlan`.

Mirrors ``extension/flat_tensor/serialize/serialize.py::FlatTensorSerializer.serialize``
(executorch 1.5.1): one segment per buffer, in key order, the first time a buffer
is named, with that key's alignment; the FlatTensor flatbuffer (``FT01``) is built
from the same JSON with the same bundled flatc as upstream, so its bytes match;
the 40-byte ``FH01`` header (padded to 48) is inserted at byte 8.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ..errors import LayoutError
from ..sources.base import Source
from ..sources.fingerprint import Fingerprint
from ..system.files import case_insensitive
from ..upstream import adapter
from .identity import FLAT_TENSOR_VERSION
from .layout import ptd_head
from .plan import DataEntry, FilePlan, FileRole, PlannedFile, SegmentPlan, assemble, named_segments, place

__all__ = ["check_ptd_file_names", "plan_data_files", "ptd_file_name"]

_INT32_MAX = (1 << 31) - 1


def ptd_file_name(tag: str) -> str:
    """``<tag>.ptd`` (upstream appends ``.ptd`` unless the tag ends with it;
    ``exir/program/_program.py::write_tensor_data_to_file``).

    Any tag upstream writes inside the output folder is accepted (``""`` gives
    ``.ptd``, ``".."`` gives ``...ptd``).

    Raises:
        LayoutError: a tag whose file name would hold a path separator or NUL,
            or be absolute: it would name a file outside the output folder (or
            none at all).
    """
    if not isinstance(tag, str):
        raise LayoutError(f"external tag {tag!r} is not a str")
    name = tag if tag.endswith(".ptd") else tag + ".ptd"
    bad = [c for c in ("/", os.sep, os.altsep, "\0") if c and c in name]
    if bad or os.path.isabs(name) or name in (".", ".."):
        raise LayoutError(
            f"external tag {tag!r} holds {bad[0] if bad else 'an absolute path'!r}: "
            "a tag names a file in the output folder and may not leave it"
        )
    return name


def check_ptd_file_names(tags: Sequence[str], folder: str) -> None:
    """Refuse two external tags that name one file, before anything is written.

    ``"w"`` and ``"w.ptd"`` both become ``w.ptd`` (upstream writes one over the
    other and loses keys); in a folder whose file system ignores case, ``"W"``
    and ``"w"`` do too. ``folder`` is probed (:func:`ptdstream.system.files.case_insensitive`)
    only when two names differ in case alone.

    Raises:
        LayoutError: naming both tags and the file.
    """
    names: dict[str, str] = {}
    for tag in tags:
        name = ptd_file_name(tag)
        if name in names:
            raise LayoutError(
                f"external tags {names[name]!r} and {tag!r} both name the file {name} "
                f"in {folder}: one would overwrite the other; rename one tag"
            )
        names[name] = tag
    folded: dict[str, str] = {}
    for name, tag in names.items():
        other = folded.setdefault(name.casefold(), name)
        if other != name and case_insensitive(folder):
            raise LayoutError(
                f"external tags {names[other]!r} and {tag!r} name the files {other} and {name}, "
                f"one file in {folder} (its file system ignores case); rename one tag"
            )


def _check_layouts(named_data: Mapping[str, DataEntry], name: str) -> None:
    """Refuse tensor sizes the schema's ``sizes: [int32]`` cannot hold.

    Upstream passes them to flatc, which fails with "constant does not fit";
    this names the key and the dimension instead.
    """
    for key, entry in named_data.items():
        layout = entry.tensor_layout
        for dim, size in enumerate(getattr(layout, "sizes", None) or ()):
            if not -_INT32_MAX - 1 <= size <= _INT32_MAX:
                raise LayoutError(
                    f"{name}: key {key!r}: dimension {dim} has size {size}, which the "
                    "FlatTensor schema's int32 sizes cannot hold; reshape the tensor so "
                    "every dimension is below 2**31"
                )


def plan_ptd(
    buffers: Sequence[Source],
    named_data: Mapping[str, DataEntry],
    *,
    segment_alignment: int = 128,
    name: str = "data.ptd",
    fingerprints: Mapping[int, Fingerprint] | None = None,
) -> FilePlan:
    """Plan one FlatTensor data file.

    Args:
        buffers: sources indexed by ``DataEntry.buffer_index``.
        named_data: ``{key: DataEntry}`` in the order upstream iterates it.
        segment_alignment: bytes; every segment starts at a multiple of
            ``lcm(segment_alignment, entry alignment)``.
        name: the file name, for messages and reports.
        fingerprints: digests already known per buffer index (integrity check).
    """
    from executorch.extension.flat_tensor.serialize.flat_tensor_schema import (
        DataSegment,
        FlatTensor,
        NamedData,
    )

    _check_layouts(named_data, name)
    segments: list[SegmentPlan] = []
    keyed = named_segments(buffers, named_data, segments, fingerprints)
    placements, data_nbytes = place(segments, segment_alignment)
    flat_tensor = FlatTensor(
        version=FLAT_TENSOR_VERSION,
        segments=[DataSegment(offset=p.offset, size=p.nbytes) for p in placements],
        named_data=[
            NamedData(key=key, segment_index=index, tensor_layout=named_data[key].tensor_layout)
            for key, index in keyed
        ],
    )
    flatbuffer = adapter.flat_tensor_to_flatbuffer(flat_tensor)
    head, base = ptd_head(flatbuffer, data_nbytes, segment_alignment)
    return assemble("ptd", name, head, base, segments, placements, len(flatbuffer))


def plan_data_files(
    buffers: Sequence[Source],
    external_data: Mapping[str, Mapping[str, DataEntry]],
    folder: str,
    *,
    segment_alignment: int = 128,
    fingerprints: Mapping[int, Fingerprint] | None = None,
) -> tuple[PlannedFile, ...]:
    """Plan ``folder/<tag>.ptd`` for each tag of ``external_data`` (``{tag: {key:
    DataEntry}}``, in upstream's tag order), all indexing ``buffers``.

    Raises:
        LayoutError: a tag that cannot name a file in ``folder``, or two tags
            that name one file (:func:`check_ptd_file_names`).
    """
    check_ptd_file_names(list(external_data), folder)
    files: list[PlannedFile] = []
    for tag, entries in external_data.items():
        name = ptd_file_name(tag)
        plan = plan_ptd(buffers, entries, segment_alignment=segment_alignment, name=name,
                        fingerprints=fingerprints)
        files.append(PlannedFile(os.path.join(folder, name), FileRole.DATA, plan))
    return tuple(files)
