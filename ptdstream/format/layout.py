"""Pure layout rules shared by the .pte and .ptd writers and by the reader.

Every byte position ptdstream writes is decided here, from sizes and alignments
alone; no function in this module touches payload. The rules mirror ExecuTorch
1.5.1:

* ``exir/_serialize/padding.py``: :func:`padding_required`, :func:`aligned_size`;
* ``exir/_serialize/_program.py``: the segment loop of ``serialize_pte_binary``,
  ``_extract_constant_segment``, ``_ExtendedHeader`` and
  ``_insert_flatbuffer_header``;
* ``extension/flat_tensor/serialize/serialize.py``: the segment loop of
  ``FlatTensorSerializer.serialize`` and ``FlatTensorHeader``.

Upstream writes the segment loop twice (once per format); here it is written once
(:func:`place_segments`). All integers in headers are little-endian; offsets and
sizes are unsigned 64-bit (files over 4 GiB are legal).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import FormatError, LayoutError
from .identity import (
    PTD_IDENTIFIER_PREFIX,
    PTE_IDENTIFIER_PREFIX,
    ExtendedHeader,
    FlatTensorHeader,
    u32,
)

__all__ = ["Placement", "SegmentSpec", "aligned_size", "check_alignment", "pack_subsegments",
           "padding_required", "place_segments", "ptd_head", "pte_head"]


def padding_required(offset: int, alignment: int) -> int:
    """Zero bytes needed after ``offset`` (bytes) to reach a multiple of ``alignment``."""
    remainder = offset % alignment
    return alignment - remainder if remainder else 0


def aligned_size(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to the next multiple of ``alignment`` (both in bytes)."""
    return nbytes + padding_required(nbytes, alignment)


def check_alignment(alignment: int | None, what: str = "alignment") -> int:
    """Normalise an upstream-style alignment: ``None`` means 1.

    Non-powers of two are accepted, as ``NamedDataStore`` accepts them (48 works;
    ``lcm(128, 48) = 384``).

    Raises:
        ValueError: ``alignment <= 0``, with upstream's text
            ("Alignment must be greater than 0, received N.").
    """
    if alignment is None:
        return 1
    if isinstance(alignment, bool) or not isinstance(alignment, int):
        raise LayoutError(f"{what} must be an int, received {alignment!r}.")
    if alignment <= 0:
        raise ValueError(f"Alignment must be greater than 0, received {alignment}.")
    return alignment


@dataclass(frozen=True)
class SegmentSpec:
    """A segment to place: its size in bytes and its own alignment (1 = none)."""

    nbytes: int
    alignment: int = 1


@dataclass(frozen=True)
class Placement:
    """Where a segment lands, relative to ``segment_base_offset`` (bytes)."""

    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        """The offset just past the placed bytes."""
        return self.offset + self.nbytes


def place_segments(
    specs: Sequence[SegmentSpec], segment_alignment: int
) -> tuple[tuple[Placement, ...], int]:
    """Place segments one after the other, the way both upstream serializers do.

    Segment ``i`` starts at ``aligned_size(end of segment i-1,
    lcm(segment_alignment, spec.alignment))``; the gaps are zero bytes; nothing
    follows the last segment; empty segments are allowed (two may share an
    offset).

    Returns:
        The placements, in order, and ``segment_data_size``: the end of the last
        segment (0 when there are none).
    """
    placements = []
    end = 0
    for spec in specs:
        alignment = math.lcm(segment_alignment, spec.alignment)
        offset = aligned_size(end, alignment)
        placements.append(Placement(offset, spec.nbytes))
        end = offset + spec.nbytes
    return tuple(placements), end


def pack_subsegments(
    sizes: Sequence[int], alignment: int | None
) -> tuple[tuple[int, ...], int]:
    """Offsets of tensors packed into one segment (the constant or mutable segment).

    Each tensor but the last is followed by zero padding up to ``alignment``
    (``None``: no padding, as for mutable data). Mirrors
    ``_program.py::_extract_constant_segment``: sizes 60, 12, 28 after the empty
    placeholder with alignment 16 give offsets (0, 0, 64, 80) and 108 bytes.

    Returns:
        The offset of each tensor within the segment and the segment's size.
    """
    offsets = []
    current = 0
    for i, nbytes in enumerate(sizes):
        offsets.append(current)
        pad = padding_required(nbytes, alignment) if alignment is not None else 0
        current += nbytes + pad
        if i == len(sizes) - 1:
            current -= pad
    return tuple(offsets), current


def insert_header(flatbuffer: bytes, header: bytes, identifier_pattern: bytes) -> bytes:
    """Insert ``header`` (already padded) at byte 8 of ``flatbuffer``.

    The root offset (u32 at byte 0) grows by ``len(header)``; the 4-byte file
    identifier stays at bytes 4..8. Mirrors ``_program.py::_insert_flatbuffer_header``.

    Raises:
        FormatError: the flatbuffer is shorter than 8 bytes or its identifier
            does not start with ``identifier_pattern`` (``b"ET"`` or ``b"FT"``).
    """
    if len(flatbuffer) < 8:
        raise FormatError(f"flatbuffer is {len(flatbuffer)} bytes, < 8")
    if not flatbuffer[4:8].startswith(identifier_pattern):
        raise FormatError(
            f"flatbuffer identifier {flatbuffer[4:8]!r} does not start with "
            f"{identifier_pattern!r}"
        )
    (root,) = struct.unpack_from("<I", flatbuffer, 0)
    return u32(root + len(header)) + flatbuffer[4:8] + header + flatbuffer[8:]


def pte_head(
    flatbuffer: bytes, max_alignment: int, segment_data_size: int, segment_alignment: int
) -> tuple[bytes, int]:
    """The bytes of a .pte before its first segment, and ``segment_base_offset``.

    ``P = aligned_size(32, max_alignment)``; the header padded with zeros to P is
    inserted at byte 8; ``program_size = P + len(flatbuffer)``; zero padding runs to
    ``segment_base_offset = aligned_size(program_size, segment_alignment)``.
    When the segments hold 0 bytes there is no header at all: the head is the raw
    flatbuffer and the base offset 0 (``serialize_pte_binary``).
    """
    if segment_data_size == 0:
        return flatbuffer, 0
    padded = aligned_size(ExtendedHeader.LENGTH, max_alignment)
    program_size = padded + len(flatbuffer)
    base = aligned_size(program_size, segment_alignment)
    header = ExtendedHeader(program_size, base, segment_data_size).to_bytes()
    header += b"\x00" * (padded - len(header))
    data = insert_header(flatbuffer, header, PTE_IDENTIFIER_PREFIX)
    return data + b"\x00" * (base - len(data)), base


def ptd_head(
    flatbuffer: bytes, segment_data_size: int, segment_alignment: int
) -> tuple[bytes, int]:
    """The bytes of a .ptd before its first segment, and ``segment_base_offset``.

    The header is always present: 40 bytes padded to 48, inserted at byte 8;
    ``segment_base_offset = aligned_size(48 + len(flatbuffer), segment_alignment)``.
    """
    padded = aligned_size(FlatTensorHeader.LENGTH, FlatTensorHeader.FLATBUFFER_ALIGNMENT)
    base = aligned_size(len(flatbuffer) + padded, segment_alignment)
    header = FlatTensorHeader(padded, len(flatbuffer), base, segment_data_size).to_bytes()
    header += b"\x00" * (padded - len(header))
    data = insert_header(flatbuffer, header, PTD_IDENTIFIER_PREFIX)
    return data + b"\x00" * (base - len(data)), base
