"""Hand ptdstream sources to upstream ExecuTorch where it accepts ``FileBackedData``.

:class:`SourceBackedData` is a ``FileBackedData`` (executorch 1.5.1,
``exir/_serialize/_cord.py``) whose bytes come from any ptdstream
:class:`~ptdstream.sources.base.Source`: a CUDA storage, a CPU tensor, an engine file
range. A backend can put it into upstream's ``NamedDataStore`` (or a ``Cord``);
upstream's own serializer then still writes the right bytes (the slow path:
SHA-256 and pieces through Python), while :func:`ptdstream.save` unwraps it and
streams the source directly (the fast path).
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..defaults import CHUNK_NBYTES
from ..sources import BufferRing, Source, as_source
from ..upstream import adapter

__all__ = ["EMITTER_HASHLIB", "ByReference", "FileBackedData", "SourceBackedData"]

#: executorch's class, found at import time (executorch is untyped: Any to the checker).
FileBackedData: Any = adapter.file_backed_data_type()


class SourceBackedData(FileBackedData):
    """A ``FileBackedData`` over a ptdstream source (no file, no copy held).

    Args:
        data: a :class:`~ptdstream.sources.base.Source` or anything
            :func:`~ptdstream.sources.as_source` takes (tensor, bytes, ...).
        chunk_nbytes: piece size for upstream's slow path (8 MiB).
        sha256: the bytes' SHA-256 when the caller already knows it (upstream's
            collector hands it over; it is then never computed here).

    Memory: upstream's ``to_bytes()`` joins the whole payload (as it does for
    any ``FileBackedData``); ``write_to_file``, ``sha256`` and ``prefix`` stream.
    """

    def __init__(self, data: Any, chunk_nbytes: int = CHUNK_NBYTES,
                 sha256: bytes | None = None) -> None:
        # No call to FileBackedData.__init__: there is no file to stat.
        self.source: Source = as_source(data, label="SourceBackedData")
        adapter.init_file_backed(self, None, self.source.nbytes, sha256)
        self._chunk_nbytes = chunk_nbytes

    def __ptdstream_source__(self) -> Source:
        """The source itself: :func:`ptdstream.sources.as_source` streams it directly."""
        return self.source

    def _pieces(self):
        return self.source.pieces(BufferRing(self._chunk_nbytes, count=3))

    def __len__(self) -> int:
        return self.source.nbytes

    def prefix(self, size: int) -> bytes:
        """The first ``size`` bytes of the data (upstream's dedup looks at them first)."""
        return self.source.prefix(size)

    def sha256(self) -> bytes:
        """The SHA-256 of the data: the one handed over, else streamed once and cached."""
        cached = adapter.cached_sha256(self)
        if cached is None:
            digest = hashlib.sha256()
            for piece in self._pieces():
                digest.update(piece)
            cached = digest.digest()
            adapter.set_cached_sha256(self, cached)
        return cached

    def to_bytes(self) -> bytes:
        """The whole data joined in memory (upstream's slow path, as for any ``FileBackedData``)."""
        return b"".join(bytes(p) for p in self._pieces())

    def write_to_file(self, outfile) -> None:
        """Write the data to ``outfile`` piece by piece."""
        for piece in self._pieces():
            outfile.write(piece)

    def close(self) -> None:
        """Nothing to remove: the source is not a temp file."""


class ByReference:
    """Mixin for a ``FileBackedData`` that stands for data it does not copy (a
    tensor storage, a file): copying returns the same object, as for ``bytes``
    (``copy.deepcopy`` of an executorch program shares it); pickling gives plain
    ``bytes`` (a full read through :meth:`to_bytes`). Inside ptdstream's
    emitter patches, ``hashlib.sha256(obj)`` is answered by ``obj.sha256()``
    (:class:`EmitterHashlib`)."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (bytes, (self.to_bytes(),))


class _Digest:
    """A finished SHA-256 (the ``digest``/``hexdigest`` part of hashlib's interface)."""

    name = "sha256"
    digest_size = 32

    def __init__(self, digest: bytes) -> None:
        self._digest = digest

    def digest(self) -> bytes:
        return self._digest

    def hexdigest(self) -> str:
        return self._digest.hex()


class EmitterHashlib:
    """``hashlib`` as executorch's emitter module sees it while ptdstream's
    patches are active: ``sha256(data)`` of a :class:`ByReference` object is
    ``data.sha256()`` (streamed from its source, never a mapping or a copy);
    everything else is hashlib's."""

    def __getattr__(self, name):
        return getattr(hashlib, name)

    @staticmethod
    def sha256(data=b"", **kwargs):
        """``hashlib.sha256(data)``, or for a :class:`ByReference` object its own streamed digest."""
        if isinstance(data, ByReference) and not kwargs:
            return _Digest(data.sha256())
        return hashlib.sha256(data, **kwargs)


EMITTER_HASHLIB = EmitterHashlib()
