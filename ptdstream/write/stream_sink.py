"""A sink over a caller's open file (upstream's ``write_to_file(open_file)``)."""

from __future__ import annotations

import io
import os
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from .sink_protocol import write_zeros

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from .sink import ChunkedFileSink

__all__ = ["StreamSink", "open_sink", "target_name"]


class Writable(Protocol):
    """What upstream's ``write_to_file`` takes: any object with a ``write`` method
    (what it accepts and returns differs between file objects, hence ``Any``)."""

    def write(self, data: Any, /) -> Any:
        """Take ``data`` (bytes or a view); what it returns is ignored."""


class StreamSink:
    """Write to a caller's open binary file object, as upstream's ``Cord.write_to_file`` does.

    Accepts what upstream accepts: any object with a ``write`` method taking bytes
    (``io`` files named, unnamed, descriptor-backed or seekable or not, pipes,
    ``tempfile`` files, write-only wrappers, compressor streams). ``io`` objects get
    views of the bytes (they copy what they keep); a raw ``io.RawIOBase`` (``FileIO``,
    ``open(..., buffering=0)``) is written again after a short write, as its
    ``write`` returns the bytes it took. Any other object gets one ``bytes`` copy
    per piece and its return value is ignored, as upstream ignores it (a
    compressor's ``write`` may count compressed bytes; a wrapper may keep the object
    it was given). Nothing is atomic or synced here: that is the caller's file.
    """

    def __init__(self, fileobj: Writable) -> None:
        self._file = fileobj
        self._raw = isinstance(fileobj, io.RawIOBase)
        self._views = isinstance(fileobj, io.IOBase)
        self.nbytes = 0

    def write(self, data: ReadableBuffer) -> None:
        """Write every byte of ``data`` to the file (a raw file again after a short write)."""
        view = memoryview(data).cast("B")
        if not self._views:
            self._file.write(bytes(view))
        elif not self._raw:
            self._file.write(view)  # buffered io writes everything or raises
        else:
            done = 0
            while done < len(view):
                n = self._file.write(view[done:])
                if n is None:  # non-blocking raw file that would block
                    raise BlockingIOError(0, "write would block", getattr(self._file, "name", None))
                done += n
        self.nbytes += len(view)

    def write_zeros(self, nbytes: int) -> None:
        """Write ``nbytes`` zero bytes."""
        write_zeros(self.write, nbytes)


def open_sink(target: str | os.PathLike[str] | Writable,
              **file_options: Any) -> AbstractContextManager[ChunkedFileSink | StreamSink]:
    """A context manager giving the sink for ``target``: a
    :class:`~ptdstream.write.sink.ChunkedFileSink` for a path (``file_options`` go
    to it; published atomically on a clean exit), or a :class:`StreamSink` over an
    open binary stream (``sys.stdout.buffer``, a pipe), which the caller owns:
    nothing is atomic there, bytes arrive as they are written."""
    import contextlib

    if isinstance(target, (str, bytes, os.PathLike)):
        from .sink import ChunkedFileSink

        return ChunkedFileSink(target, **file_options)
    return contextlib.nullcontext(StreamSink(target))


def target_name(target: str | os.PathLike[str] | Writable) -> str:
    """How a report names ``target``: the path, or ``"-"`` for a stream."""
    return os.fspath(target) if isinstance(target, (str, bytes, os.PathLike)) else "-"
