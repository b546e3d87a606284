"""What a sink is: the ``Sink`` protocol the writer writes to, the states of a
sink that publishes (``SinkState``), and ``write_zeros`` (padding from one shared
zero buffer).

The sink that publishes a file atomically is :mod:`ptdstream.write.sink`; the one
over a caller's open file is :mod:`ptdstream.write.stream_sink`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = ["Sink", "SinkState", "write_zeros"]

_ZEROS = bytes(1 << 20)


@runtime_checkable
class Sink(Protocol):
    """Where the writer puts a file's bytes, in order (:func:`ptdstream.write.writer.write_plan`).

    ``write(data)`` appends every byte of a bytes-like object (looping on short
    writes); ``write_zeros(nbytes)`` appends zero bytes. Implementations:
    :class:`~ptdstream.write.sink.ChunkedFileSink` (a temp file published atomically) and
    :class:`~ptdstream.write.stream_sink.StreamSink` (a caller's open file).
    """

    def write(self, data: ReadableBuffer) -> None:
        """Append every byte of ``data`` (any bytes-like object), looping on short writes."""

    def write_zeros(self, nbytes: int) -> None:
        """Append ``nbytes`` zero bytes."""


def write_zeros(write: Callable[[memoryview], None], nbytes: int) -> None:
    """Call ``write`` with views of a shared 1 MiB zero buffer until ``nbytes``
    zero bytes (``nbytes >= 0``) were written."""
    view = memoryview(_ZEROS)
    while nbytes > 0:
        n = min(nbytes, len(_ZEROS))
        write(view[:n])
        nbytes -= n


class SinkState(enum.Enum):
    """Where a :class:`~ptdstream.write.sink.ChunkedFileSink` stands: ``OPEN`` (its
    temp file created), ``WRITING``, ``SYNCED``, then ``COMMITTED`` (published);
    ``ABORTED`` (temp file removed) from any state before ``COMMITTED``."""

    OPEN = "open"
    WRITING = "writing"
    SYNCED = "synced"
    COMMITTED = "committed"
    ABORTED = "aborted"
