"""Stream a :class:`~ptdstream.plan.FilePlan` into a sink, checking every source.

Each source is read once: its pieces go to the sink and, on the way, into an
xxh3-128 digest. A source must still give exactly the bytes it promised at plan
time: its size, its first 32 bytes, and, when the plan already knew its digest
(dedup candidates), that digest. Otherwise :class:`~ptdstream.errors.IntegrityError`
names the key, the file and the output offset, and the caller aborts the sink:
nothing is published.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from .errors import IntegrityError
from .fingerprint import Fingerprint, StreamingDigest
from .plan import ExtentKind, FilePlan
from .sources import BufferRing

#: ``progress(nbytes)`` is called after each piece with the bytes just written.
ProgressFn = Callable[[int], None]


def write_plan(
    plan: FilePlan,
    sink,
    ring: BufferRing,
    progress: Optional[ProgressFn] = None,
) -> Dict[str, Fingerprint]:
    """Write every extent of ``plan`` to ``sink`` in order.

    Args:
        plan: the file's plan.
        sink: an open :class:`~ptdstream.sink.ChunkedFileSink` (or any object with
            ``write(bytes_like)`` and ``write_zeros(n)``).
        ring: reused buffers for file sources.
        progress: called with the bytes of each piece written.

    Returns:
        ``{section label: Fingerprint}`` for every payload extent.

    Raises:
        IntegrityError: a source's size, prefix or digest differs from the plan.
        OSError: from the sink.
    """
    fingerprints: Dict[str, Fingerprint] = {}
    offset = 0
    for extent in plan.extents:
        if extent.kind is ExtentKind.METADATA:
            sink.write(extent.data)
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


def _write_source(plan, extent, offset, sink, ring, progress) -> Fingerprint:
    digest = StreamingDigest()
    where = f"{extent.label()} of {plan.name} at offset {offset}"
    first = True
    for piece in _checked_pieces(extent.source.pieces(ring), where):
        if first:
            head = bytes(piece[: len(extent.prefix)])
            if head != extent.prefix[: len(head)]:
                raise IntegrityError(
                    f"{where}: {extent.source.describe()} changed since the plan "
                    "(its first bytes differ); nothing was published"
                )
            first = False
        if digest.nbytes + len(piece) > extent.nbytes:
            raise IntegrityError(
                f"{where}: {extent.source.describe()} gave more than the "
                f"{extent.nbytes} bytes planned; nothing was published"
            )
        digest.update(piece)
        sink.write(piece)
        if progress is not None:
            progress(len(piece))
    if digest.nbytes != extent.nbytes:
        raise IntegrityError(
            f"{where}: {extent.source.describe()} gave {digest.nbytes} bytes, "
            f"{extent.nbytes} planned; nothing was published"
        )
    result = digest.finish()
    if extent.fingerprint is not None and result != extent.fingerprint:
        raise IntegrityError(
            f"{where}: {extent.source.describe()} changed since the plan (digest "
            f"{result.hex} != {extent.fingerprint.hex}); nothing was published"
        )
    return result


def _checked_pieces(pieces, where: str):
    """Re-raise a source's failure with the key, file and offset prefixed."""
    while True:
        try:
            piece = next(pieces)
        except StopIteration:
            return
        except IntegrityError as e:
            raise IntegrityError(f"{where}: {e}; nothing was published") from e
        except Exception as e:  # noqa: BLE001 - a source failing mid-stream
            raise IntegrityError(
                f"{where}: reading the source failed ({type(e).__name__}: {e}); "
                "nothing was published"
            ) from e
        yield piece
