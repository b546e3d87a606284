"""The temp files of a distributed write (steps 3 and 4 of
:mod:`ptdstream.distributed.protocol`): rank 0 creates one per ``.ptd`` at its full
size; every rank ``pwrite``s its own pieces into them, digesting each as written.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..defaults import WINDOW_NBYTES
from ..errors import IntegrityError
from ..sources import BufferRing, Source
from ..sources.fingerprint import StreamingDigest, check_expected

__all__ = ["create_temp_files", "write_pieces"]


def write_pieces(wire, local, offsets, rank: int, chunk_nbytes: int, progress: Callable[[int], object]) -> int:
    """pwrite this rank's pieces into the temp files, window by window to disk and
    out of the page cache (:class:`~ptdstream.system.writeback.WritebackWindows`),
    digesting each piece as written, ``progress(bytes)`` after each; fsync; drop
    their pages.

    Raises:
        IntegrityError: a piece whose first bytes, size or digest differ from
            those taken at hand-over (naming rank, key, file and offset).
        OSError: a write failed (naming rank and file).
    """
    from ..system.files import pwrite_all
    from ..system.pagecache import drop_pages
    from ..system.writeback import WritebackWindows

    ring = BufferRing(chunk_nbytes, count=1)
    written = 0
    for target, temp, _, writes in wire:
        mine = [(key, at) for key, at, _ in writes if key in local and local[key][0].nbytes]
        if not mine:
            continue
        fd = os.open(temp, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        writeback = WritebackWindows(fd)
        try:
            for key, at in mine:
                source, _, head = local[key]
                position = at + offsets[(key, rank)]
                where = f"{target} at offset {position}: "
                digest = StreamingDigest()
                for piece in _pieces_of(source, ring, where):
                    if digest.nbytes == 0 and bytes(piece[: len(head)]) != head[: len(piece)]:
                        raise IntegrityError(f"{where}{source.describe()} changed after it was handed over (its "
                                             "first bytes differ from the plan's); nothing was published")
                    if digest.nbytes + len(piece) > source.nbytes:
                        raise IntegrityError(f"{where}{source.describe()} gave more than the {source.nbytes} "
                                             "bytes planned; nothing was published")
                    n = pwrite_all(fd, piece, position)
                    writeback.written(position, n)
                    digest.update(piece)  # the bytes as written (or later)
                    position += n
                    written += n
                    progress(n)
                if digest.nbytes != source.nbytes:
                    raise IntegrityError(f"{where}{source.describe()} gave {digest.nbytes} bytes, "
                                         f"{source.nbytes} planned; nothing was published")
                check_expected(source, digest.finish(), where)
            writeback.close()
            os.fsync(fd)
            drop_pages(fd, 0, 0)
        except OSError as e:
            raise OSError(e.errno, f"rank {rank}: writing {temp} (for {target}) failed: {e.strerror}") from e
        finally:
            try:
                writeback.close()  # its thread has ended, even when Ctrl-C comes
            finally:
                os.close(fd)
    return written


def _pieces_of(source: Source, ring: BufferRing, where: str):
    """``source.pieces(ring)``, its IntegrityError (storage freed, GPU fingerprint
    changed) prefixed with the file and offset."""
    pieces = source.pieces(ring)
    while True:
        try:
            piece = next(pieces)
        except StopIteration:
            return
        except IntegrityError as e:
            raise IntegrityError(f"{where}{e}") from e
        yield piece


def create_temp_files(files):
    """Rank 0: a sink (temp file) per file, at its full size (the gaps read as zeros)."""
    from ..write.publish import prepare_folders
    from ..write.sink import ChunkedFileSink

    prepare_folders(target for target, _ in files)  # once per folder, before any temp file
    sinks = []
    try:
        for target, plan in files:
            sink = ChunkedFileSink(target, window_nbytes=WINDOW_NBYTES, clean_folder=False)
            sinks.append(sink)
            os.truncate(sink.temp_path, plan.nbytes)
    except BaseException:
        for sink in sinks:
            sink.abort()
        raise
    return sinks
