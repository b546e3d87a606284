"""Stream a :class:`~ptdstream.format.plan.FilePlan` into a sink, checking every source.

Each source is read once: its pieces go to the sink and, on the way, into an
xxh3-128 digest. A source must still give exactly the bytes it promised at plan
time: its size, its first 32 bytes, and, when the plan already knew its digest
(dedup candidates), that digest. Otherwise :class:`~ptdstream.errors.IntegrityError`
names the key, the file and the output offset, and the caller aborts the sink:
nothing is published.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import cast

from ..errors import IntegrityError
from ..format.plan import Extent, ExtentKind, FilePlan
from ..sources.base import BufferRing, Source
from ..sources.fingerprint import Fingerprint, StreamingDigest, check_expected
from ..system.threads import FdThread
from ..timeline import stage_timeline
from .sink_protocol import Sink

__all__ = ["write_plan"]

#: ``progress(nbytes)`` is called after each piece with the bytes just written.
ProgressFn = Callable[[int], object]

#: Pieces at least this large go to the writer thread; smaller writes are made
#: inline (after the thread's pending write), where a hand-off would cost more.
THREAD_MIN_NBYTES = 256 << 10


class _WriterThread:
    """One background thread writing one piece at a time into the sink.

    ``write(piece)`` waits until the previous piece is written, then hands this one
    over and returns, so reading and hashing the next piece overlap this write
    (``os.write`` releases the GIL). At most one piece is in the thread: sources
    that reuse buffers keep one slot for it (see ``sources.cuda.CudaTensorSource``). An
    error in the thread is raised by the next ``write`` or by ``close``.
    """

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._idle = threading.Semaphore(1)
        self._ready = threading.Semaphore(0)
        self._piece: bytes | memoryview | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = FdThread(self._serve, "ptdstream-writer")

    def _serve(self) -> None:
        while True:
            self._ready.acquire()
            piece = self._piece
            if piece is None or self._stopping:
                return
            try:
                if self._error is None:
                    timeline = stage_timeline()
                    if timeline is None:
                        self._sink.write(piece)
                    else:
                        t = time.perf_counter()
                        self._sink.write(piece)
                        timeline.add("sink write (writer thread)", time.perf_counter() - t, len(piece))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._error = e
            finally:
                self._piece = None
                self._idle.release()

    def _wait_idle(self) -> None:
        self._idle.acquire()
        if self._error is not None:
            self._idle.release()
            raise self._error

    def write(self, piece: bytes | memoryview) -> None:
        self._wait_idle()
        if len(piece) < THREAD_MIN_NBYTES:
            try:
                self._sink.write(piece)
            finally:
                self._idle.release()
            return
        self._piece = piece
        self._ready.release()

    def drain(self) -> None:
        """Wait until every piece handed over is written (raises the thread's error)."""
        self._wait_idle()
        self._idle.release()

    def write_zeros(self, nbytes: int) -> None:
        self._wait_idle()
        try:
            self._sink.write_zeros(nbytes)
        finally:
            self._idle.release()

    def close(self) -> None:
        """Wait for the last piece, stop the thread, raise its error if any."""
        self._idle.acquire()
        self._piece = None
        self._ready.release()
        interrupted = self._thread.wait()
        if interrupted is not None:
            raise interrupted
        if self._error is not None:
            raise self._error

    def abort(self) -> KeyboardInterrupt | None:
        """Stop the thread after the write in progress, from whatever state a
        hand-off was interrupted in (``close`` would wait for an idle slot that
        the interrupted caller may hold). Waits through Ctrl-C and returns the
        interrupt: the sink's file descriptor must not be closed while the thread
        may still write to it (the number could be reused by another file)."""
        self._stopping = True
        self._ready.release()
        return self._thread.wait()


def write_plan(
    plan: FilePlan,
    sink: Sink,
    ring: BufferRing,
    progress: ProgressFn | None = None,
    threaded: bool = True,
) -> dict[str, Fingerprint]:
    """Write every extent of ``plan`` to ``sink`` in order.

    Args:
        plan: the file's plan.
        sink: a :class:`~ptdstream.write.sink_protocol.Sink` (an open
            :class:`~ptdstream.write.sink.ChunkedFileSink`, a ``StreamSink``).
        ring: reused buffers for file sources.
        progress: called with the bytes of each piece handed to the sink.
        threaded: write large pieces from a background thread, overlapping
            reading and hashing with the file writes (one piece in flight).

    Returns:
        ``{section label: Fingerprint}`` for every payload extent.

    Raises:
        IntegrityError: a source's size, prefix or digest differs from the plan.
        OSError: from the sink.
    """
    if threaded:
        writer = _WriterThread(sink)
        try:
            result = _write_extents(plan, writer, ring, progress)
            writer.close()
        except BaseException as e:
            interrupted = writer.abort()  # the thread has ended when it returns
            if interrupted is not None and not isinstance(e, KeyboardInterrupt):
                raise interrupted from e
            raise
        return result
    return _write_extents(plan, sink, ring, progress)


def _write_extents(plan: FilePlan, sink: Sink | _WriterThread, ring: BufferRing,
                   progress: ProgressFn | None) -> dict[str, Fingerprint]:
    fingerprints: dict[str, Fingerprint] = {}
    offset = 0
    for extent in plan.extents:
        if extent.kind is ExtentKind.METADATA:
            sink.write(cast(bytes, extent.data))  # a METADATA extent holds its bytes
        elif extent.kind is ExtentKind.ZEROS:
            sink.write_zeros(extent.nbytes)
        else:
            fingerprints[extent.label()] = _write_source(plan, extent, offset, sink, ring, progress)
            offset += extent.nbytes
            continue
        if progress is not None:
            progress(extent.nbytes)
        offset += extent.nbytes
    return fingerprints


def _write_source(plan: FilePlan, extent: Extent, offset: int, sink: Sink | _WriterThread, ring: BufferRing,
                  progress: ProgressFn | None) -> Fingerprint:
    """Write one source's pieces, digesting each piece once it has been written.

    The previous piece is hashed while the writer thread writes the current one,
    so the digest covers the bytes as they were when written (or later): a memory
    source changed before or during its write no longer matches the fingerprint
    taken when it was handed over (``source.expectation.fingerprint``) and is refused.
    """
    digest = StreamingDigest()
    where = f"{extent.label()} of {plan.name} at offset {offset}"
    nbytes = 0
    written: memoryview | None = None  # the piece last handed to the sink: hashed once it is written
    timeline = stage_timeline()
    source = cast(Source, extent.source)  # a SOURCE extent holds its source (Extent.payload)
    for piece in _checked_pieces(source.pieces(ring), where):
        if nbytes == 0:
            head = bytes(piece[: len(extent.prefix)])
            if head != extent.prefix[: len(head)]:
                raise IntegrityError(
                    f"{where}: {source.describe()} changed since the plan "
                    "(its first bytes differ); nothing was published"
                )
        if nbytes + len(piece) > extent.nbytes:
            raise IntegrityError(
                f"{where}: {source.describe()} gave more than the "
                f"{extent.nbytes} bytes planned; nothing was published"
            )
        nbytes += len(piece)
        if timeline is None:
            sink.write(piece)  # returns once the previous piece is written
            if written is not None:
                digest.update(written)
        else:
            t0 = time.perf_counter()
            sink.write(piece)
            t1 = time.perf_counter()
            timeline.add("hand-off to the writer (waits for its last write)", t1 - t0)
            if written is not None:
                digest.update(written)
                timeline.add("xxh3 digest", time.perf_counter() - t1, len(written))
        written = piece
        if progress is not None:
            progress(len(piece))
    if written is not None:
        drain = getattr(sink, "drain", None)
        if drain is not None:
            drain()
        t1 = time.perf_counter()
        digest.update(written)
        if timeline is not None:
            timeline.add("xxh3 digest", time.perf_counter() - t1, len(written))
    if digest.nbytes != extent.nbytes:
        raise IntegrityError(
            f"{where}: {source.describe()} gave {digest.nbytes} bytes, "
            f"{extent.nbytes} planned; nothing was published"
        )
    result = digest.finish()
    check_expected(source, result, where=f"{where}: ")
    if extent.fingerprint is not None and result != extent.fingerprint:
        raise IntegrityError(
            f"{where}: {source.describe()} changed since the plan (digest "
            f"{result.hex} != {extent.fingerprint.hex}); nothing was published"
        )
    return result


def _checked_pieces(pieces: Iterator[memoryview], where: str) -> Iterator[memoryview]:
    """Re-raise a source's failure with the key, file and offset prefixed."""
    while True:
        try:
            piece = next(pieces)
        except StopIteration:
            return
        except IntegrityError as e:
            raise IntegrityError(f"{where}: {e}; nothing was published") from e
        except Exception as e:
            raise IntegrityError(
                f"{where}: reading the source failed ({type(e).__name__}: {e}); "
                "nothing was published"
            ) from e
        yield piece
