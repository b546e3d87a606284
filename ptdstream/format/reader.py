"""Read a .pte or .ptd back into a section map, trusting no size field.

:func:`read_artifact` reads only the first 64 bytes and the metadata flatbuffer;
segment payload is never read. Every size and offset taken from the file is
checked against the file size (and against the other header fields) before
anything is read or allocated from it, so a header claiming a 2^60-byte segment
fails at once. Anything invalid raises :class:`~ptdstream.errors.FormatError`
with one line naming the file and the offset of the bad field.

The kind comes from the file identifier (:mod:`.identity`), not the name:
:mod:`.pte_reader` reads programs, :mod:`.ptd_reader` FlatTensor data files.
"""

from __future__ import annotations

import os

from ..errors import FormatError
from ..system.files import open_input, pread_bytes
from .artifact import Artifact, ReadAt, fail
from .identity import HEAD_NBYTES, is_zstd, kind_of
from .ptd_reader import parse_ptd
from .pte_reader import parse_pte

__all__ = ["HEAD_NBYTES", "Artifact", "parse_artifact", "read_artifact"]


def read_artifact(path: str) -> Artifact:
    """Parse the .pte or .ptd at ``path`` (kind from its identifier, not its name).

    Memory: 64 bytes plus the metadata flatbuffer, whose size is checked against
    the file size first. Segment payload is not read.

    Raises:
        FormatError: invalid or truncated file (one line: file, offset, problem).
        OSError: the file cannot be opened or read.
    """
    path = os.fspath(path)
    with open_input(path) as f:
        nbytes = os.fstat(f.fileno()).st_size
        fd = f.fileno()

        def read_at(offset: int, count: int) -> bytes:
            data = pread_bytes(fd, count, offset)
            if len(data) != count:
                raise FormatError(f"{path}: at offset {offset}: read {len(data)} of {count} bytes (file changed?)")
            return data

        return parse_artifact(path, nbytes, read_at)


def parse_artifact(name: str, nbytes: int, read_at: ReadAt) -> Artifact:
    """Like :func:`read_artifact`, over any random-access source of ``nbytes`` bytes."""
    if nbytes < 8:
        raise fail(name, 0, f"file is {nbytes} bytes, shorter than a flatbuffer's 8-byte prefix")
    head = read_at(0, min(nbytes, HEAD_NBYTES))
    ident = head[4:8]
    kind = kind_of(ident)
    if kind is None and is_zstd(head):
        raise fail(name, 0, "a zstd-compressed file (ptdstream pack's, or any zstd tool's), not a .pte/.ptd: "
                            f"ptdstream unpack {name} gives the file (ptdstream extract {name} --list: what a "
                            "packed one holds)")
    if kind is None:
        raise fail(name, 4, f"identifier {ident!r} is neither ET.. (.pte) nor FT.. (.ptd): not an ExecuTorch file")
    if kind == "pte":
        return parse_pte(name, nbytes, head, read_at)
    return parse_ptd(name, nbytes, head, read_at)
