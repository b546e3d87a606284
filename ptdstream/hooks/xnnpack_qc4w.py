"""XNNPACK's 4-bit packing of a large weight band by band into a file, with upstream's bytes.

executorch 1.5.1's XNNPACK backend packs each 4-bit weight it serializes
(``backends/xnnpack/operators/node_visitor.py``, ``NodeVisitor.convert_to_qc4w``,
called by ``get_serialized_buffer_index``): it checks the values are in
[-8, 7] (``min``/``max`` of the whole tensor), adds 8 as ``uint8`` and puts
each pair of neighbours of a row into one byte, the odd column in the high
nibble. Whole, that is two temporaries the size of the int8 weight and two of
half its size at once (about 1 GiB for a 128,256 x 4,096 head), and the check
reads every page of a weight mapped from a file into the process.

With an even number of columns each row packs into its own bytes, so packing
bands of rows and appending them gives the same bytes. Inside
:func:`packing_qc4w_in_bands` (the thread or task that entered it), a 2-D
``torch.int8`` CPU weight (a plain tensor or ``Parameter``) of at least :data:`BANDED_MIN_NBYTES` with an even
number of columns is packed in bands of about :data:`BAND_NBYTES` of its rows
into ``rows()`` (a :class:`RowSink`: a nameless file), the pages read of a
weight mapped from a file handed back after each band; the result, a tensor
over that file, is registered with
:func:`~ptdstream.hooks.xnnpack.reference_converted`, so that XNNPACK's two
``bytes()`` calls of it get a reference to its storage (hashed and saved from
the file) rather than a copy. Any other input, or a band with a value outside
[-8, 7], goes to upstream's function as it is (its own checks and errors). The
patch is scoped through :mod:`ptdstream.upstream.patching`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..system.pagecache import file_mapping, release_mapped
from ..upstream import adapter
from ..upstream.patching import shadowed
from .xnnpack import reference_converted

__all__ = ["BANDED_MIN_NBYTES", "BAND_NBYTES", "RowSink", "pack_qc4w_in_bands", "packing_qc4w_in_bands"]

#: An int8 weight at least this large (bytes) is packed in bands inside :func:`packing_qc4w_in_bands`.
BANDED_MIN_NBYTES = 16 << 20
#: About the int8 bytes of one band of rows.
BAND_NBYTES = 8 << 20

_rows: contextvars.ContextVar = contextvars.ContextVar("ptdstream_qc4w_rows", default=None)
_ids = itertools.count()
_open: set = set()


class RowSink(Protocol):
    """Where packed rows go: each band appended under one name, then the whole tensor
    (:class:`ptdstream.weightless.mapped_copy.RowFiles` is one)."""

    def append(self, name: str, band: Any) -> None:
        """Write ``band``'s rows (a contiguous CPU tensor) after those of ``name`` appended before."""

    def finish(self) -> dict[str, Any]:
        """Each name's rows, one contiguous tensor over its file."""

    def __enter__(self) -> RowSink: ...

    def __exit__(self, *exc: object) -> None: ...


def _bandable(inp: Any) -> bool:
    import torch

    return (type(inp) in (torch.Tensor, torch.nn.Parameter) and inp.device.type == "cpu"
            and inp.dtype == torch.int8 and inp.dim() == 2 and inp.is_contiguous() and inp.shape[1] % 2 == 0
            and inp.numel() >= BANDED_MIN_NBYTES)


def pack_qc4w_in_bands(inp: Any, sink: RowSink, band_nbytes: int | None = None) -> Any | None:
    """``convert_to_qc4w(inp)``'s result built band by band into ``sink``: a
    ``torch.uint8`` tensor ``(rows, columns / 2)`` over ``sink``'s file, or None
    (nothing returned, ``sink`` to be discarded) when a value is outside [-8, 7].

    ``inp``: a 2-D contiguous ``torch.int8`` CPU tensor with an even number of
    columns; ``band_nbytes``: about the int8 bytes of a band (default
    :data:`BAND_NBYTES`). Resident: about one band and its packed half (the pages
    read of ``inp``, when it is a file mapping, handed back after each band)."""
    import torch

    rows, cols = inp.shape
    step = max(1, (BAND_NBYTES if band_nbytes is None else band_nbytes) // max(cols, 1))
    mapping = file_mapping(inp.data_ptr(), rows * cols)
    with torch.no_grad():
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            band = inp[r0:r1]
            if band.max().item() > 7 or band.min().item() < -8:
                return None
            flat = (band.to(dtype=torch.uint8) + 8).contiguous().view(-1)
            sink.append("packed", (flat[1::2] << 4 | flat[::2]).view(r1 - r0, cols // 2))
            del band, flat
            if mapping is not None:
                release_mapped(inp.data_ptr() + r0 * cols, (r1 - r0) * cols, (mapping.start, mapping.stop))
    return sink.finish()["packed"]


def _banded(real: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(real)
    def convert_to_qc4w(inp):
        make = _rows.get()
        if make is None or not any(i in _open for i in make[0]) or not _bandable(inp):
            return real(inp)
        with make[1]() as sink:
            packed = pack_qc4w_in_bands(inp, sink)
        if packed is None:  # a value out of range: upstream's own check and message
            return real(inp)
        reference_converted(packed)
        return packed

    return convert_to_qc4w


@contextlib.contextmanager
def packing_qc4w_in_bands(rows: Callable[[], RowSink]) -> Iterator[None]:
    """While active in this thread or task (inside
    :func:`~ptdstream.hooks.xnnpack.xnnpack_constants_by_reference`), XNNPACK packs
    each large 4-bit weight band by band into a new ``rows()`` (module docstring);
    nests (the innermost ``rows`` is used). Does nothing when executorch's
    XNNPACK backend is not importable."""
    try:
        visitor, real = adapter.xnnpack_qc4w_packer()
    except ImportError:
        yield
        return
    context_id = next(_ids)
    _open.add(context_id)
    outer = _rows.get()
    token = _rows.set(((outer[0] if outer else ()) + (context_id,), rows))
    try:
        with shadowed(visitor, "convert_to_qc4w", staticmethod(_banded(real))):
            yield
    finally:
        _open.discard(context_id)
        try:
            _rows.reset(token)
        except ValueError:
            pass  # exited in another thread: the id is closed, which is what counts
