"""Checkpoints as sources: every tensor of a checkpoint by key, its layout, and its
bytes streamed in pieces, never loaded whole (except DCP, one tensor at a time).

Kinds, each read through its own library:

* ``.safetensors`` file, or a Hugging Face sharded checkpoint
  (``model.safetensors.index.json``, its ``weight_map`` naming each key's shard):
  ``safetensors.safe_open`` maps the file; each tensor is a view of that
  mapping, whose file range is read piece by piece with ``pread``, its pages
  dropped after each piece (:class:`~ptdstream.sources.mapped.MappedTensorSource`
  with ``read_file``; through the mapping if the file was replaced since).
* a ``torch.save`` state dict (a flat ``{key: tensor}``): ``torch.load(mmap=True,
  weights_only=True)``, read the same way (through the mapping for an archive
  of the other byte order, which ``torch.load`` swaps in memory).
* a ``torch.distributed.checkpoint`` (DCP) directory, only when named
  (``format="dcp"``): its ``.metadata`` is a pickle, which runs code when
  read, so it is never chosen by detection. ``FileSystemReader``'s
  metadata gives every key's dtype and shape; the bytes are loaded with
  ``torch.distributed.checkpoint.load`` one tensor at a time, into a tensor
  freed as soon as its pieces are written (DCP stores each chunk as a
  ``torch.save`` record, so the largest tensor is held once, plus DCP's copy of
  its chunk while loading).

Memory: a mapped tensor costs about one piece (``chunk_nbytes``, 8 MiB) of
resident pages at a time; a DCP tensor costs its size while it is written (and
once while planning, to take its first bytes and digest).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import FormatError, IntegrityError, MissingKeyError, StateError
from .base import BufferRing, Expectation, FileIdentity, Source
from .fingerprint import Fingerprint, StreamingDigest
from .safetensors_header import check_safetensors_header
from .tensor import TensorSource

if TYPE_CHECKING:
    import torch
    from safetensors import safe_open

__all__ = ["Checkpoint", "DcpTensorSource", "open_checkpoint"]

#: The file Hugging Face writes beside the shards of a sharded safetensors checkpoint.
HF_INDEX_NAME = "model.safetensors.index.json"
#: The metadata file of a DCP directory (``torch.distributed.checkpoint.filesystem._metadata_fn``).
DCP_METADATA_NAME = ".metadata"
#: The formats :func:`open_checkpoint` takes; ``"auto"`` detects all but ``"dcp"``.
FORMATS = ("auto", "safetensors", "torch", "dcp")


@dataclass(frozen=True)
class CheckpointEntry:
    """One tensor of a checkpoint: its key, torch dtype, shape and dim order (from
    its strides; ``(0, 1, ..., n-1)`` for row-major), and its size in bytes."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    dim_order: tuple[int, ...]
    nbytes: int
    where: str


class Checkpoint:
    """A checkpoint opened for reading: ``entries`` (metadata only, in the
    checkpoint's own order) and :meth:`source` for a key's bytes.

    Use as a context manager (or call :meth:`close`): mappings and readers are
    released at exit. ``kind`` is ``"safetensors"``, ``"torch"`` or ``"dcp"``.
    """

    kind = ""

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: dict[str, CheckpointEntry] = {}
        #: Keys whose tensor is the same memory as another key's -> the first such key.
        self.aliases: dict[str, str] = {}

    def source(self, key: str) -> Source:
        """A :class:`~ptdstream.sources.Source` over the bytes of ``key``, in the
        tensor's memory order (``nbytes`` bytes)."""
        raise NotImplementedError

    def tensor(self, key: str) -> torch.Tensor:
        """``key``'s tensor as a view of the checkpoint's file mapping (safetensors,
        ``torch.save``): its dtype, shape and strides as in :attr:`entries`, nothing
        read until it is used; one view per key, the same object each call; valid
        while the mapping lives (the view keeps it after :meth:`close`).

        Raises:
            MissingKeyError: the checkpoint has no tensor ``key`` (names the key
                and the checkpoint).
            FormatError: a kind whose tensors are loaded, not mapped (DCP): read
                it with :meth:`source`.
            StateError: called after :meth:`close`.
        """
        if key not in self.entries:
            raise MissingKeyError(f"{self.path}: no tensor {key!r} in this {self.kind} checkpoint "
                                  f"({len(self.entries)} tensors); check the key (or key_map)")
        mapped = self._mapped()
        if mapped is None:
            raise FormatError(f"{self.path}: key {key!r}: a {self.kind} checkpoint is loaded, not "
                              "memory-mapped: it has no mapped view; read its bytes with source(key)")
        if key not in mapped:
            raise StateError(f"{self.path}: key {key!r}: tensor() called after the checkpoint was closed: "
                             "call it while the checkpoint is open")
        return mapped[key]

    def _mapped(self) -> dict[str, torch.Tensor] | None:
        """The mapped views by key, or None for a kind that loads its tensors."""
        return None

    def files(self) -> list[str]:
        """The files it reads: ``path`` itself, or every regular file directly in
        it for a folder (a writer refuses to replace any of them)."""
        from ..system.files import files_of

        return files_of(self.path)

    def close(self) -> None:
        """Release mappings and readers."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dim_order(tensor: torch.Tensor) -> tuple[int, ...]:
    from executorch.exir.tensor import dim_order_from_stride

    if tensor.dim() == 0:
        return ()
    return tuple(int(d) for d in dim_order_from_stride(tensor.stride()))


def _entry(key: str, tensor: torch.Tensor, where: str) -> CheckpointEntry:
    return CheckpointEntry(
        key, tensor.dtype, tuple(int(s) for s in tensor.shape), _dim_order(tensor),
        tensor.numel() * tensor.element_size(), where,
    )


def _opened(path: str, open_file: Callable[[], None]) -> FileIdentity:
    """Run ``open_file()`` (which maps the checkpoint file at ``path``) and return
    the file's identity, the same before and after it (what each source checks).

    Raises:
        IntegrityError: the file was replaced or written to while it was opened.
    """
    before = FileIdentity.of(os.stat(path))
    open_file()
    after = FileIdentity.of(os.stat(path))
    if after != before:
        raise IntegrityError(
            f"checkpoint file {path}: changed while it was opened (device, inode, size, modification "
            f"and change time {tuple(before)} before, {tuple(after)} after); a checkpoint must not "
            "change while it is saved"
        )
    return before


def _mapped_source(tensor: torch.Tensor, label: str, opened: FileIdentity, read_file: bool = True) -> Source:
    """A source read from the file with ``pread`` when the tensor lies in a file
    mapping (the mapping is the checkpoint's own, never handed out, so it holds
    the file's bytes), else a plain tensor source. ``opened``: the checkpoint
    file's identity when it was opened, checked at every read."""
    from ..system.pagecache import file_mapping
    from .mapped import MappedTensorSource

    nbytes = tensor.numel() * tensor.element_size()
    if nbytes:
        mapping = file_mapping(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if mapping is not None:
            return MappedTensorSource(tensor, mapping, label, read_file=read_file,
                                      expectation=Expectation(file=opened))
    return TensorSource(tensor, label)


class SafetensorsCheckpoint(Checkpoint):
    """One ``.safetensors`` file, or the shards named by a Hugging Face index.

    Every file's header is checked first (:func:`check_safetensors_header`).

    Raises:
        FormatError: an index that is not JSON or has no ``weight_map``, a shard
            that does not hold the key its index names, a header that lies, or
            a file safetensors refuses.
    """

    kind = "safetensors"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._handles: dict[str, safe_open] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        #: each file -> its identity when it was opened (checked at every read)
        self._opened: dict[str, FileIdentity] = {}
        if path.endswith(".json"):
            shards = _hf_weight_map(path)
            folder = os.path.dirname(path)
        else:
            shards, folder = None, os.path.dirname(path)
        files = [os.path.basename(path)] if shards is None else list(dict.fromkeys(shards.values()))
        try:
            for name in files:
                file = os.path.join(folder, name)
                self._opened[file] = _opened(file, functools.partial(self._open_file, file, name, shards))
        except (FormatError, IntegrityError):
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' own errors (SafetensorError, OSError), reported
            raise FormatError(f"{path}: safetensors could not read it: {type(e).__name__}: {e}") from None
        if shards is not None:
            lost = [k for k in shards if k not in self.entries]
            if lost:
                raise FormatError(
                    f"{path}: {len(lost)} key(s) named by the index are not in their shard: "
                    + ", ".join(f"{k!r} ({shards[k]})" for k in lost[:20])
                )

    def _open_file(self, file: str, name: str, shards: dict[str, str] | None) -> None:
        from safetensors import safe_open

        check_safetensors_header(file)
        handle = safe_open(file, framework="pt")
        self._handles[file] = handle
        for key in handle.keys():  # type: ignore[no-untyped-call]  # safetensors' stub: unannotated
            if shards is not None and shards.get(key) != name:
                continue  # the index names another shard for it
            # a view of the mapping: nothing read yet
            tensor = handle.get_tensor(key)  # type: ignore[no-untyped-call]  # safetensors' stub: unannotated
            self._tensors[key] = tensor
            self.entries[key] = _entry(key, tensor, file)

    def files(self) -> list[str]:
        return [*([self.path] if self.path.endswith(".json") else []), *self._opened]

    def _mapped(self) -> dict[str, torch.Tensor]:
        return self._tensors

    def source(self, key: str) -> Source:
        where = self.entries[key].where
        return _mapped_source(self._tensors[key], f"{where}: key {key!r}", self._opened[where])

    def close(self) -> None:
        self._tensors.clear()
        self._handles.clear()


def _hf_weight_map(path: str) -> dict[str, str]:
    try:
        with open(path, "rb") as f:
            index = json.load(f)
        shards = index["weight_map"]
        if not isinstance(shards, dict) or not all(isinstance(v, str) for v in shards.values()):
            raise TypeError("weight_map is not {key: file name}")
    except (ValueError, KeyError, TypeError) as e:
        raise FormatError(f"{path}: not a Hugging Face safetensors index: {type(e).__name__}: {e}") from None
    for name in set(shards.values()):
        if os.path.basename(name) != name or name in (".", ".."):
            raise FormatError(f"{path}: shard name {name!r} is not a file name in the index's folder")
    return shards


def _archive_byteorder(path: str) -> str:
    """The byte order a ``torch.save`` archive records (``<archive>/byteorder``;
    little when absent, as ``torch.load`` assumes); "unknown" if unreadable."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("/byteorder") and n.count("/") == 1]
            return archive.read(names[0]).decode("ascii").strip() if names else "little"
    except (OSError, zipfile.BadZipFile, UnicodeDecodeError):
        return "unknown"


class TorchCheckpoint(Checkpoint):
    """A ``torch.save`` state dict, loaded with ``torch.load(mmap=True,
    weights_only=True)``: a flat ``{str: tensor}`` dict. Keys whose tensor is the
    very same memory as an earlier key's (tied weights saved twice) are listed in
    ``aliases``: every key of such a group -> the group's first key.

    Raises:
        FormatError: not a state dict, or values that are not CPU tensors.
    """

    kind = "torch"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        import torch

        loaded: list[object] = []
        try:
            self._opened = _opened(path, lambda: loaded.append(
                torch.load(path, mmap=True, weights_only=True, map_location="cpu")))
        except IntegrityError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of torch.load is reported as FormatError
            raise FormatError(f"{path}: torch.load(mmap=True, weights_only=True) failed: "
                              f"{type(e).__name__}: {e}") from None
        state = loaded[0]
        if not isinstance(state, dict):
            raise FormatError(f"{path}: holds a {type(state).__name__}, not a state dict {{key: tensor}}")
        bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise FormatError(f"{path}: {len(bad)} entries are not str -> tensor: {bad[:20]!r}")
        self._tensors = state
        self._native = _archive_byteorder(path) == sys.byteorder
        seen: dict[tuple[object, ...], str] = {}
        for key, tensor in state.items():
            ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.dtype,
                     tuple(tensor.shape), tuple(tensor.stride()))
            if tensor.numel() and ident in seen:
                self.aliases[key] = self.aliases[seen[ident]] = seen[ident]
            seen.setdefault(ident, key)
            self.entries[key] = _entry(key, tensor, path)

    def source(self, key: str) -> Source:
        # torch.load byte-swaps (in its private mapping) an archive saved with the
        # other byte order: then only the mapping has the bytes to write.
        return _mapped_source(self._tensors[key], f"{self.path}: key {key!r}", self._opened,
                              read_file=self._native)

    def _mapped(self) -> dict[str, torch.Tensor]:
        return self._tensors

    def close(self) -> None:
        self._tensors = {}


class DcpTensorSource(Source):
    """One tensor of a DCP checkpoint, loaded with DCP's reader when read.

    :meth:`prefix` loads it once to take its first bytes and its xxh3-128 digest
    (kept as ``expected_fingerprint``: the write checks the second load against
    it); :meth:`pieces` loads it again and frees it after the last piece.
    """

    #: A checkpoint on disk: the second load is checked against the first.
    is_mutable = False

    def __init__(self, folder: str, entry: CheckpointEntry,
                 load: Callable[[str, CheckpointEntry], torch.Tensor]) -> None:
        self.folder = folder
        self.entry = entry
        self.nbytes = entry.nbytes
        self._load = load
        self._prefix: bytes | None = None
        self.expected_fingerprint: Fingerprint | None = None

    @property
    def expectation(self) -> Expectation:
        """The first load's digest (once :meth:`prefix` has run): the write checks the second load."""
        return Expectation(fingerprint=self.expected_fingerprint)

    def describe(self) -> str:
        return f"{self.folder}: key {self.entry.key!r}"

    def _tensor_source(self) -> TensorSource:
        return TensorSource(self._load(self.entry.key, self.entry), self.describe())

    def prefix(self, nbytes: int = 32) -> bytes:
        if self._prefix is None:
            source = self._tensor_source()
            digest = StreamingDigest()
            for piece in source.pieces(BufferRing(count=1)):
                digest.update(piece)
            self._prefix = source.prefix(32)
            self.expected_fingerprint = digest.finish()
        return self._prefix[:nbytes]

    def same_content(self, other: Source) -> bool | None:
        if isinstance(other, DcpTensorSource) and other.nbytes == self.nbytes:
            self.prefix()
            other.prefix()
            return self.expected_fingerprint == other.expected_fingerprint
        return None

    def pieces(self, ring: BufferRing) -> Iterator[memoryview]:
        # Copied into the ring: a piece may still be being written (by the writer
        # thread) after this generator ends and the loaded tensor is freed.
        source = self._tensor_source()
        for piece in source.pieces(ring):
            buf = ring.next()[: len(piece)]
            buf[:] = piece
            yield buf


class DcpCheckpoint(Checkpoint):
    """A ``torch.distributed.checkpoint`` directory (``FileSystemReader``).

    Only tensor entries are listed; other entries (bytes, Python objects) are in
    ``skipped``.

    Raises:
        FormatError: DCP cannot read the metadata.
    """

    kind = "dcp"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            metadata = FileSystemReader(path).read_metadata()
        except Exception as e:  # noqa: BLE001 - any failure of DCP's reader is reported as FormatError
            raise FormatError(f"{path}: DCP could not read its metadata: {type(e).__name__}: {e}") from None
        self.skipped: list[str] = []
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                self.skipped.append(key)
                continue
            shape = tuple(int(s) for s in md.size)
            numel = 1
            for s in shape:
                numel *= s
            itemsize = _itemsize(md.properties.dtype)
            self.entries[key] = CheckpointEntry(
                key, md.properties.dtype, shape, tuple(range(len(shape))), numel * itemsize, path
            )

    def _load_one(self, key: str, entry: CheckpointEntry) -> torch.Tensor:
        import torch
        import torch.distributed.checkpoint as dcp

        tensor = torch.empty(entry.shape, dtype=entry.dtype)
        try:
            dcp.load({key: tensor}, storage_reader=dcp.FileSystemReader(self.path), no_dist=True)
        except Exception as e:  # noqa: BLE001 - any failure of DCP's load is reported as IntegrityError
            raise IntegrityError(f"{self.path}: key {key!r}: DCP could not load it: {type(e).__name__}: {e}") from None
        return tensor

    def source(self, key: str) -> Source:
        return DcpTensorSource(self.path, self.entries[key], self._load_one)


def _itemsize(dtype: torch.dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _safetensors_in(path: str) -> str | None:
    """The safetensors checkpoint a folder holds: its index, its
    ``model.safetensors``, or its one ``*.safetensors`` file; None if none.

    Raises:
        FormatError: several ``*.safetensors`` files and no index.
    """
    for name in (HF_INDEX_NAME, "model.safetensors"):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if len(found) > 1:
        raise FormatError(f"{path}: {len(found)} .safetensors files ({', '.join(found[:5])}) and no "
                          f"{HF_INDEX_NAME}: name the file to read")
    return os.path.join(path, found[0]) if found else None


def open_checkpoint(path: str, format: str = "auto") -> Checkpoint:
    """Open the checkpoint at ``path``.

    ``format="auto"`` finds the kind from what is there, and only among the
    kinds whose reading runs no code of the checkpoint:

    * a ``*.safetensors`` file, a ``*.json`` Hugging Face index, or a directory
      holding ``model.safetensors.index.json``, ``model.safetensors`` or a
      single ``*.safetensors``: safetensors (a ``.metadata`` beside them is
      ignored);
    * any other file: a ``torch.save`` state dict, read with
      ``torch.load(weights_only=True)``.

    ``format="dcp"`` reads a ``torch.distributed.checkpoint`` directory: its
    ``.metadata`` is a pickle, and unpickling runs whatever code it names, so
    name this format only for a checkpoint you trust; it is never detected.
    ``"safetensors"`` and ``"torch"`` name the other kinds.

    Raises:
        FileNotFoundError: nothing at ``path``, or a directory of none of these kinds.
        FormatError: a directory holding ``.metadata`` and no safetensors, without
            ``format="dcp"``; a safetensors checkpoint named as DCP; a format
            that does not fit ``path``; the checkpoint cannot be read (see each kind).
        ValueError: ``format`` is none of :data:`FORMATS`.
    """
    path = os.fspath(path)
    if format not in FORMATS:
        raise ValueError(f"checkpoint format {format!r} is none of {', '.join(FORMATS)}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint")
    folder = os.path.isdir(path)
    safetensors = _safetensors_in(path) if folder else (path if path.endswith((".safetensors", ".json")) else None)
    if format == "dcp":
        if safetensors is not None:
            raise FormatError(f"{path}: holds a safetensors checkpoint ({os.path.basename(safetensors)}), "
                              "which is never read as DCP: leave out format='dcp' (--format dcp)")
        if not folder or not os.path.isfile(os.path.join(path, DCP_METADATA_NAME)):
            raise FormatError(f"{path}: not a DCP checkpoint (a folder holding {DCP_METADATA_NAME})")
        return DcpCheckpoint(path)
    if format == "torch":
        if folder:
            raise FormatError(f"{path}: a folder, not a torch.save file")
        return TorchCheckpoint(path)
    if safetensors is not None or (format == "safetensors" and not folder):
        return SafetensorsCheckpoint(safetensors or path)
    if format == "safetensors":
        raise FormatError(f"{path}: holds no safetensors checkpoint (*.safetensors or {HF_INDEX_NAME})")
    if folder:
        if os.path.isfile(os.path.join(path, DCP_METADATA_NAME)):
            raise FormatError(
                f"{path}: holds {DCP_METADATA_NAME}, a torch.distributed.checkpoint (DCP) folder: its metadata is "
                "a pickle, which runs code when read, so it is never read unasked; pass --format dcp "
                "(format='dcp') if you trust this checkpoint")
        raise FileNotFoundError(
            f"{path}: a directory with neither {HF_INDEX_NAME}, model.safetensors, a *.safetensors file "
            f"nor {DCP_METADATA_NAME} (DCP, with --format dcp)"
        )
    return TorchCheckpoint(path)
