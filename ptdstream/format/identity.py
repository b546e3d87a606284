"""Format identity: every magic, identifier, version and header length of .pte and .ptd.

Supporting a new format version starts and mostly ends here: the planners
(:mod:`.layout`), the readers (:mod:`.reader`), verify (:mod:`ptdstream.check`)
and pack (:mod:`ptdstream.pack`) take these values from this module only.

Mirrors executorch 1.5.1: ``schema/program.fbs`` (file identifier ``ET12``),
``exir/_serialize/_program.py::_ExtendedHeader`` (``eh00``, read by the runtime's
``schema/extended_header.cpp``), ``extension/flat_tensor/serialize/flat_tensor.fbs``
(``FT01``) and ``serialize.py::FlatTensorHeader`` (``FH01``, read by
``flat_tensor_header.cpp``), ``FlatTensorDataMap::kMaxSupportedSchemaVersion``.
All integers are little-endian; offsets and sizes are unsigned 64-bit.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, fields
from typing import ClassVar, TypeVar

__all__ = [
    "FLAT_TENSOR_VERSION",
    "HEADER_OFFSET",
    "HEAD_NBYTES",
    "MAX_SUPPORTED_FLAT_TENSOR_VERSION",
    "PTD_IDENTIFIER_PREFIX",
    "PTE_IDENTIFIER_PREFIX",
    "SKIPPABLE_MAGIC_BASE",
    "ExtendedHeader",
    "FlatTensorHeader",
    "InsertedHeader",
    "ZSTD_MAGIC",
    "expected_identifier",
    "is_zstd",
    "kind_of",
    "u32",
]

#: Offset of an inserted header: after the flatbuffer's root offset (u32) and its
#: 4-byte file identifier.
HEADER_OFFSET = 8
#: Bytes read to find a header (upstream's ``_ExtendedHeader.NUM_HEAD_BYTES``).
HEAD_NBYTES = 64

#: The .pte program flatbuffer's file identifier, and the prefix every version shares.
PTE_IDENTIFIER = b"ET12"
PTE_IDENTIFIER_PREFIX = b"ET"
#: The .ptd FlatTensor flatbuffer's file identifier, and its version-free prefix.
PTD_IDENTIFIER = b"FT01"
PTD_IDENTIFIER_PREFIX = b"FT"
#: Any identifier the readers recognise: a known prefix and two version characters.
IDENTIFIER_PATTERN = re.compile(rb"(ET|FT)[0-9a-zA-Z]{2}\Z")

#: ``FlatTensor.version`` written (``serialize.py::_FLAT_TENSOR_VERSION``) and the
#: highest the runtime loads (``FlatTensorDataMap::kMaxSupportedSchemaVersion``).
FLAT_TENSOR_VERSION = 0
MAX_SUPPORTED_FLAT_TENSOR_VERSION = 0


#: The first 4 bytes (little-endian) of a zstd frame, and the base of the 16 skippable
#: frame magics (zstd's ``doc/zstd_compression_format.md``): a file that starts with
#: either is compressed (``ptdstream pack``'s output, or any zstd tool's), no .pte/.ptd.
ZSTD_MAGIC = 0xFD2FB528
SKIPPABLE_MAGIC_BASE = 0x184D2A50


def is_zstd(head: bytes) -> bool:
    """Whether a file whose first bytes are ``head`` starts with a zstd frame or a
    skippable frame."""
    if len(head) < 4:
        return False
    magic = int.from_bytes(head[:4], "little")
    return magic == ZSTD_MAGIC or magic & ~0xF == SKIPPABLE_MAGIC_BASE


def kind_of(identifier: bytes) -> str | None:
    """``"pte"`` or ``"ptd"`` for a file identifier (bytes 4..8 of a file) the
    readers recognise, else None."""
    if not IDENTIFIER_PATTERN.match(identifier):
        return None
    return "pte" if identifier.startswith(PTE_IDENTIFIER_PREFIX) else "ptd"


def expected_identifier(kind: str) -> bytes:
    """The identifier the runtime expects for a file of ``kind`` ("pte"/"ptd")."""
    return PTE_IDENTIFIER if kind == "pte" else PTD_IDENTIFIER


def u32(value: int) -> bytes:
    """``value`` as a little-endian unsigned 32-bit integer."""
    return struct.pack("<I", value)


def u64(value: int) -> bytes:
    """``value`` as a little-endian unsigned 64-bit integer."""
    return struct.pack("<Q", value)


_H = TypeVar("_H", bound="InsertedHeader")


@dataclass(frozen=True)
class InsertedHeader:
    """A header inserted at byte 8 of a flatbuffer (after its root offset and file
    identifier): ``MAGIC`` (4 bytes), u32 length, then one u64 per field of the
    subclass before ``length``, in field order.

    A reader accepts a length of at least ``MINIMUM_LENGTH`` (the fields ending
    within it must be there); the fields past it are read only when the length
    is at least ``LENGTH``, else they are 0. A writer always writes ``LENGTH``.
    ``length`` is the length the header bytes gave (``LENGTH`` for one built here).
    """

    MAGIC: ClassVar[bytes]
    LENGTH: ClassVar[int]
    MINIMUM_LENGTH: ClassVar[int]

    def to_bytes(self) -> bytes:
        """The ``LENGTH`` header bytes: always the full length."""
        return self.MAGIC + u32(self.LENGTH) + b"".join(u64(getattr(self, name)) for name in self._u64_fields())

    @classmethod
    def from_bytes(cls: type[_H], data: bytes) -> _H | None:
        """Parse the bytes at file offset 8; ``None`` if no valid header is there."""
        if len(data) < cls.MINIMUM_LENGTH or data[0:4] != cls.MAGIC:
            return None
        (length,) = struct.unpack_from("<I", data, 4)
        if length < cls.MINIMUM_LENGTH:
            return None
        names = cls._u64_fields()
        required = (cls.MINIMUM_LENGTH - 8) // 8  # after the magic and the length
        if length >= cls.LENGTH:
            if len(data) < cls.LENGTH:
                return None
            required = len(names)
        values = dict.fromkeys(names, 0)  # a field past the length read is 0
        values.update(zip(names, struct.unpack_from(f"<{required}Q", data, 8), strict=False))
        values["length"] = length
        return cls(**values)

    @classmethod
    def _u64_fields(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "length"]


@dataclass(frozen=True)
class ExtendedHeader(InsertedHeader):
    """The .pte extended header, inserted at byte 8 of the program flatbuffer.

    Byte layout (``_program.py::_ExtendedHeader``; read by
    ``schema/extended_header.cpp``): ``b"eh00"``, u32 length (32 written, >= 24
    accepted), u64 program_size (header + flatbuffer, bytes), u64
    segment_base_offset, u64 segment_data_size (only when length >= 32).
    """

    MAGIC: ClassVar[bytes] = b"eh00"
    MINIMUM_LENGTH: ClassVar[int] = 24
    LENGTH: ClassVar[int] = 32

    program_size: int
    segment_base_offset: int
    segment_data_size: int
    length: int = LENGTH


@dataclass(frozen=True)
class FlatTensorHeader(InsertedHeader):
    """The .ptd header, inserted at byte 8 of the FlatTensor flatbuffer.

    Byte layout (``flat_tensor/serialize/serialize.py::FlatTensorHeader``; read by
    ``flat_tensor_header.cpp``): ``b"FH01"``, u32 length (40), u64
    flatbuffer_offset (48), u64 flatbuffer_size, u64 segment_base_offset, u64
    segment_data_size. 8 zero bytes follow it, so 48 bytes are inserted.
    """

    MAGIC: ClassVar[bytes] = b"FH01"
    LENGTH: ClassVar[int] = 40
    MINIMUM_LENGTH: ClassVar[int] = LENGTH
    #: The flatbuffer is aligned to 16 after the header (``_FLATBUFFER_ALIGNMENT``).
    FLATBUFFER_ALIGNMENT: ClassVar[int] = 16

    flatbuffer_offset: int
    flatbuffer_size: int
    segment_base_offset: int
    segment_data_size: int
    length: int = LENGTH
