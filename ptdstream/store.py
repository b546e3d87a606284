"""``StreamingNamedDataStore``: upstream ``NamedDataStore`` semantics over sources.

Mirrors ``exir/_serialize/_named_data_store.py`` (executorch 1.5.1) rule for rule:

* keys are global across the .pte and every external tag;
* a new key whose data equals an existing buffer shares that buffer (the first
  key's buffer, with the new key's own alignment and layout in its entry);
* an existing key with equal data is a no-op: the new alignment, tag and layout
  are ignored (despite upstream's docstring, no lcm is taken);
* an existing key with other data raises upstream's exact ``ValueError``;
* ``alignment=None`` means 1, ``alignment <= 0`` raises upstream's ``ValueError``.

The difference is what is held: upstream keeps each buffer as ``bytes`` and
confirms equality with SHA-256; this store keeps :class:`~ptdstream.sources.base.Source`
objects (nothing is copied) and digests with xxh3-128 only the buffers whose
``(nbytes, first 32 bytes)`` collide with another's (see
:mod:`ptdstream.sources.fingerprint`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .format.layout import check_alignment
from .format.plan import DataEntry
from .sources import BufferRing, Source, as_source, is_tensor
from .sources.fingerprint import CandidateKey, Fingerprint, candidate_key, check_expected, fingerprint

__all__ = ["DataEntry", "NamedDataOutput", "StreamingNamedDataStore"]


@dataclass
class NamedDataOutput:
    """The store's result, shaped like upstream's ``NamedDataStoreOutput``.

    ``buffers`` are sources (not bytes); ``pte_data`` is ``{key: DataEntry}``;
    ``external_data`` is ``{tag: {key: DataEntry}}`` with empty tags removed.
    """

    buffers: list[Source]
    pte_data: dict[str, DataEntry]
    external_data: dict[str, dict[str, DataEntry]]
    fingerprints: dict[int, Fingerprint] = field(default_factory=dict)


class StreamingNamedDataStore:
    """Named data keyed like upstream's store, held as sources.

    Calls, in order: 1) ``add_named_data`` / ``merge_named_data_store`` any number
    of times; 2) ``get_named_data_store_output`` for the planner.

    Memory: one :class:`~ptdstream.sources.base.BufferRing` for digesting file sources
    (``chunk_nbytes`` bytes, allocated on first use), plus metadata. Not
    thread-safe.
    """

    def __init__(self, ring: BufferRing | None = None) -> None:
        self.buffers: list[Source] = []
        self.pte_data: dict[str, DataEntry] = {}
        self.external_data: dict[str, dict[str, DataEntry]] = {}
        self._ring = ring or BufferRing(count=1)
        self._candidates: dict[CandidateKey, list[int]] = {}
        self._fingerprints: dict[int, Fingerprint] = {}
        self._key_to_buffer: dict[str, int] = {}
        #: Bytes not stored because an equal buffer was already there.
        self.dedup_saved_nbytes = 0
        # Digest of the source being added, computed at most once per add.
        self._pending: dict[Source, Fingerprint] = {}

    def _buffer_fingerprint(self, index: int) -> Fingerprint:
        fp = self._fingerprints.get(index)
        if fp is None:
            fp = fingerprint(self.buffers[index], self._ring)
            check_expected(self.buffers[index], fp)
            self._fingerprints[index] = fp
        return fp

    def _equal(self, index: int, source: Source) -> bool:
        """Whether buffer ``index`` holds the same bytes as ``source``.

        Identity first; then the sizes; then the sources' own comparison (CUDA
        sources: GPU fingerprints, confirmed exactly on the device); else the
        xxh3-128 digests, each source read at most once for it.
        """
        old = self.buffers[index]
        if old is source:
            return True
        if old.nbytes != source.nbytes:
            return False
        same = source.same_content(old)
        if same is not None:
            return same
        fp = self._pending.get(source)
        if fp is None:
            fp = self._pending[source] = fingerprint(source, self._ring)
            check_expected(source, fp)
        return fp == self._buffer_fingerprint(index)

    def add_named_data(
        self,
        key: str,
        data: Any,
        alignment: int | None = 1,
        external_tag: str | None = None,
        tensor_layout: Any = None,
    ) -> None:
        """Add ``data`` under ``key``, in the .pte (``external_tag=None``) or in ``<tag>.ptd``.

        Args:
            key: the name the runtime looks the data up by.
            data: bytes, bytearray, memoryview, a CPU or CUDA tensor (its layout is
                inferred), executorch ``FileBackedData`` or a ptdstream
                :class:`~ptdstream.sources.Source`. Nothing is copied.
            alignment: bytes; ``None`` means 1; any positive int (48 is fine).
            external_tag: the data file's tag, or ``None`` for the .pte.
            tensor_layout: executorch ``TensorLayout`` of the data, if a tensor.

        Raises:
            ValueError: ``alignment <= 0``; ``key`` already holds other data
                (upstream's text, with both sizes in bytes); a tensor whose layout
                disagrees with ``tensor_layout``.
            TypeError: an unsupported data type.
            IntegrityError: a tensor whose storage was already freed (a mutable
                source is digested as it is handed over: ``Source.hand_over``).
        """
        alignment = check_alignment(alignment)
        if is_tensor(data):
            from executorch.exir.tensor_layout import TensorLayout

            real_layout = TensorLayout.from_tensor(data)
            if tensor_layout is not None and not (real_layout == tensor_layout):
                raise ValueError(
                    f"Tensor {key} is a torch.Tensor, with tensor_layout {real_layout}. "
                    f"The provided tensor layout {tensor_layout} does not match."
                )
            tensor_layout = real_layout
        source = as_source(data, label=f"key {key!r}").hand_over()
        target = (
            self.pte_data
            if external_tag is None
            else self.external_data.setdefault(external_tag, {})
        )
        self._add(key, source, alignment, target, tensor_layout)

    def _add(
        self,
        key: str,
        source: Source,
        alignment: int,
        target: dict[str, DataEntry],
        tensor_layout: Any,
    ) -> None:
        existing = self._key_to_buffer.get(key)
        if existing is not None:
            old = self.buffers[existing]
            equal = self._equal(existing, source)
            self._pending.clear()
            if not equal:
                raise ValueError(
                    f"Duplicate key {key} with different data. "
                    f"Existing data size: {old.nbytes} bytes. "
                    f"New data size: {source.nbytes} bytes."
                )
            return
        index = -1
        ckey = candidate_key(source)
        candidates = self._candidates.get(ckey)
        if candidates is not None:
            for candidate in candidates:
                if self._equal(candidate, source):
                    index = candidate
                    self.dedup_saved_nbytes += source.nbytes
                    break
        if index == -1:
            index = len(self.buffers)
            self.buffers.append(source)
            self._candidates.setdefault(ckey, []).append(index)
            if source in self._pending:
                self._fingerprints[index] = self._pending.pop(source)
        self._pending.clear()
        target[key] = DataEntry(index, alignment, tensor_layout)
        self._key_to_buffer[key] = index

    def merge_named_data_store(self, other: Any) -> None:
        """Add every entry of ``other`` (upstream ``NamedDataStoreOutput`` or
        :class:`NamedDataOutput`): its .pte data first, then each tag in order.

        Raises:
            ValueError: a key of ``other`` already holds different data here.
        """
        sources: dict[int, Source] = {}

        def source_of(index: int) -> Any:
            data = other.buffers[index]
            if is_tensor(data):
                return data
            if index not in sources:
                sources[index] = as_source(data, label=f"buffer {index}")
            return sources[index]

        groups = [(None, other.pte_data)] + list(other.external_data.items())
        for tag, entries in groups:
            for key, entry in entries.items():
                self.add_named_data(
                    key,
                    source_of(entry.buffer_index),
                    entry.alignment,
                    external_tag=tag,
                    tensor_layout=entry.tensor_layout,
                )

    def get_named_data_store_output(self) -> NamedDataOutput:
        """The buffers and entries, with empty tags removed (as upstream)."""
        self.external_data = {k: v for k, v in self.external_data.items() if len(v) > 0}
        return NamedDataOutput(
            self.buffers, self.pte_data, self.external_data, dict(self._fingerprints)
        )
