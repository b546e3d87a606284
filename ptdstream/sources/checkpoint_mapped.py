"""The memory-mapped checkpoint kinds: a ``.safetensors`` file or Hugging Face
shards (mapped as ``safetensors.safe_open`` maps them), and a ``torch.save`` state dict
(``torch.load(mmap=True, weights_only=True)``); each key's bytes read from the
file with ``pread`` (:class:`~ptdstream.sources.mapped.MappedTensorSource`),
each file's identity taken once, when it is opened (non-blocking, a regular
file only: :func:`_opened`).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, cast

from ..errors import CheckpointFileError, FormatError, IntegrityError
from .base import Expectation, FileIdentity, Source
from .checkpoint_base import Checkpoint, CheckpointEntry
from .safetensors_header import check_safetensors_header
from .tensor import TensorSource

if TYPE_CHECKING:
    import torch

__all__ = ["SafetensorsCheckpoint", "TorchCheckpoint"]


def _dim_order(tensor: torch.Tensor) -> tuple[int, ...]:
    """The dim order upstream's emitter gives ``tensor`` as a constant
    (``exir/emit/_emitter.py``: a tensor neither contiguous nor channels-last
    is made ``.contiguous()`` first; ``exir/tensor.py`` ``dim_order_from_stride``:
    dims by stride, largest first, ties in order). A tensor with a zero stride
    (an expanded view, ``Tensor.expand``) is row-major: its ``.contiguous()``
    value, whose bytes :func:`_expanded_source` writes."""
    strides = tensor.stride()
    if 0 in strides:
        return tuple(range(tensor.dim()))
    return tuple(sorted(range(tensor.dim()), key=lambda d: -strides[d]))


def _expanded_source(tensor: torch.Tensor, label: str) -> Source:
    """The bytes upstream writes for an expanded view (a zero stride): its
    ``.contiguous()`` value's, row-major. Memory: that value, made here (the view
    repeats memory that the file holds once)."""
    return TensorSource(tensor.contiguous(), f"{label} (expanded, written as .contiguous())")


def _entry(key: str, tensor: torch.Tensor, where: str) -> CheckpointEntry:
    return CheckpointEntry(
        key, tensor.dtype, tuple(int(s) for s in tensor.shape), _dim_order(tensor),
        tensor.numel() * tensor.element_size(), where,
    )


def _opened(path: str, read: Callable[[str], None]) -> FileIdentity:
    """Open the checkpoint file at ``path`` without blocking (a regular file only:
    :func:`~ptdstream.system.files.open_input_fd`), run ``read(name)`` (which maps
    it) on a name of that very file (``/proc/self/fd/N`` where there is one:
    what the library opens is the file checked, even if ``path`` is replaced in
    between), and return the file's identity, the same before and after it
    (what each source checks).

    Raises:
        OSError: ``path`` cannot be opened, or is no regular file (a FIFO, socket,
            device or folder, named with its kind), naming it.
        IntegrityError: the file was replaced or written to while it was opened.
    """
    from ..system.files import open_input_fd

    fd = open_input_fd(path)
    try:
        before = FileIdentity.of(os.fstat(fd))
        read(_name_of(fd, path))
        after = FileIdentity.of(os.stat(path))
    finally:
        os.close(fd)
    if after != before:
        raise IntegrityError(
            f"checkpoint file {path}: changed while it was opened (device, inode, size, modification "
            f"and change time {tuple(before)} before, {tuple(after)} after); a checkpoint must not "
            "change while it is saved"
        )
    return before


def _name_of(fd: int, path: str) -> str:
    """A name that opens the file ``fd`` is open on: ``/proc/self/fd/N`` (Linux),
    else ``path``."""
    name = f"/proc/self/fd/{fd}"
    return name if os.path.exists(name) else path


def _unreadable(error: BaseException, path: str) -> OSError | None:
    """``error`` when it says the file could not be opened or read (an ``OSError``
    with an errno: permission, missing, a folder), naming ``path`` if it names no
    file; else None (the file reads but is not a checkpoint)."""
    if not isinstance(error, OSError) or error.errno is None:
        return None
    if error.filename is None:
        error.filename = path
    return error


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
        CheckpointFileError: a shard the index names that is missing, cannot be
            read (a folder, no permission) or lies outside the index's folder
            (names the index, the shard and its keys).
        OSError: a single file that cannot be opened or read (permission), naming it.
    """

    kind = "safetensors"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        #: each file -> its private mapping (made when it is opened)
        self._storages: dict[str, torch.UntypedStorage] = {}
        #: the views made so far (:meth:`_view`: on first use)
        self._tensors: dict[str, torch.Tensor] = {}

        #: each file -> its identity when it was opened (checked at every read)
        self._opened: dict[str, FileIdentity] = {}
        if path.endswith(".json"):
            shards = _hf_weight_map(path)
            folder = os.path.dirname(path)
        else:
            shards, folder = None, os.path.dirname(path)
        files = [os.path.basename(path)] if shards is None else list(dict.fromkeys(shards.values()))
        if shards is not None:
            for name in sorted(set(files)):  # every shard's state first: one error names the first bad one
                _check_shard(path, folder, name, shards)
        try:
            for name in files:
                file = os.path.join(folder, name)
                self._opened[file] = _opened(file, functools.partial(self._open_file, file, name, shards))
        except (FormatError, IntegrityError):
            raise
        except Exception as e:  # safetensors' own errors (SafetensorError, OSError), reported
            unreadable = _unreadable(e, path)
            if unreadable is not None and shards is not None:  # a shard that went away or broke meanwhile
                raise _shard_error(path, os.path.basename(str(unreadable.filename)), shards,
                                   unreadable) from None
            if unreadable is not None:  # cannot be read: not a bad file
                raise
            raise FormatError(f"{path}: safetensors could not read it: {type(e).__name__}: {e}") from None
        if shards is not None:
            lost = [k for k in shards if k not in self.entries]
            if lost:
                raise FormatError(
                    f"{path}: {len(lost)} key(s) named by the index are not in their shard: "
                    + ", ".join(f"{k!r} ({shards[k]})" for k in lost[:20])
                )

    def _open_file(self, file: str, name: str, shards: dict[str, str] | None, opened: str) -> None:
        """Check and map ``file`` (``opened``: a name of it, see :func:`_opened`),
        as ``safetensors.safe_open`` maps it (``UntypedStorage.from_file``, private):
        its entries come from the checked header; no tensor is made yet."""
        import torch

        header = check_safetensors_header(opened, file)
        self._storages[file] = cast("torch.UntypedStorage", torch.UntypedStorage.from_file(
            opened, shared=False, nbytes=os.stat(opened).st_size))
        orders: dict[int, tuple[int, ...]] = {}  # row-major dim order by rank, one tuple each
        tensors = header.tensors
        for key in sorted(tensors):  # safe_open's keys(): sorted; each record dropped once used
            dtype_name, shape, begin, end = tensors.pop(key)
            if shards is not None and shards.get(key) != name:
                continue  # the index names another shard for it
            dtype = _torch_dtype(dtype_name)
            if dtype is None:
                raise FormatError(f"{file}: key {key!r}: dtype {dtype_name} has no torch dtype here (torch "
                                  f"{torch.__version__}); safetensors' torch loader cannot read it either")
            order = orders.setdefault(len(shape), tuple(range(len(shape))))
            self.entries[key] = CheckpointEntry(key, dtype, shape, order, end - begin, file,
                                                header.data_offset + begin)

    def _view(self, key: str) -> torch.Tensor:
        """``key``'s tensor, a view of its file's mapping made on first use, as
        ``safe_open(...).get_tensor`` makes it (the bytes as a ``uint8`` tensor,
        viewed as the dtype, reshaped): nothing read."""
        import torch

        tensor = self._tensors.get(key)
        if tensor is None:
            entry = self.entries[key]
            start = cast(int, entry.offset)  # every entry of this kind has one (made above)
            storage = self._storages[entry.where][start:start + entry.nbytes]
            tensor = torch.asarray(storage, dtype=torch.uint8).view(entry.dtype).reshape(entry.shape)
            self._tensors[key] = tensor
        return tensor

    def files(self) -> list[str]:
        return [*([self.path] if self.path.endswith(".json") else []), *self._opened]

    def _mapped(self) -> _LazyViews:
        return _LazyViews(self)

    def _source(self, key: str) -> Source:
        where = self.entries[key].where
        return _mapped_source(self._view(key), f"{where}: key {key!r}", self._opened[where])

    def range_source(self, key: str, offset: int, nbytes: int) -> Source:
        where = self.entries[key].where
        return _mapped_source(_byte_range(self.tensor(key), key, offset, nbytes),
                              f"{where}: key {key!r} bytes {offset}:{offset + nbytes}", self._opened[where])

    def close(self) -> None:
        self._tensors.clear()
        self._storages.clear()


class _LazyViews(Mapping[str, "torch.Tensor"]):
    """The views of a safetensors checkpoint as :meth:`Checkpoint.tensor` asks for
    them: its keys (not derived ones) while their file is open, each view made on
    first use."""

    def __init__(self, checkpoint: SafetensorsCheckpoint) -> None:
        self._checkpoint = checkpoint

    def __getitem__(self, key: str) -> torch.Tensor:
        ckpt = self._checkpoint
        entry = ckpt.entries.get(key)
        if entry is None or key in ckpt.derived or entry.where not in ckpt._storages:
            raise KeyError(key)
        return ckpt._view(key)

    def __iter__(self) -> Iterator[str]:
        return (key for key in self._checkpoint.entries if key in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype safetensors gives a tensor of dtype ``name`` (its
    ``safetensors/torch.py`` ``_TYPES``), or None (packed 4- and 6-bit floats, a
    dtype this torch lacks)."""
    import torch

    attr = _TORCH_DTYPES.get(name)
    return getattr(torch, attr, None) if attr is not None else None


#: safetensors' dtype names -> torch's dtype attributes (``safetensors/torch.py`` ``_TYPES``).
_TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                 "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                 "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2",
                 "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
                 "U64": "uint64", "U32": "uint32", "U16": "uint16"}


def _keys_of(name: str, shards: dict[str, str]) -> str:
    keys = [k for k, v in shards.items() if v == name]
    return f"{len(keys)} key(s): {', '.join(repr(k) for k in keys[:2])}{', ...' if len(keys) > 2 else ''}"


def _shard_error(index: str, name: str, shards: dict[str, str], error: OSError) -> CheckpointFileError:
    folder = os.path.dirname(index) or "."
    file = os.path.join(folder, name)
    if isinstance(error, FileNotFoundError):
        what = (f"is not in {folder} (the folder is incomplete: copy the shard there, or save or download the "
                "model again)")
    else:
        what = f"cannot be read: {error.strerror or error}"
    return CheckpointFileError(error.errno, f"{index}: shard {name!r} (for {_keys_of(name, shards)}) {what}",
                               file)


def _check_shard(index: str, folder: str, name: str, shards: dict[str, str]) -> None:
    """Refuse a shard the index names that is missing or not a readable regular file
    (a FIFO, socket, device or folder: named with its kind, never waited on).

    Raises:
        CheckpointFileError: names the index, the shard and its keys.
    """
    from ..system.files import open_input_fd

    file = os.path.join(folder, name)
    try:
        os.close(open_input_fd(file))
    except OSError as e:
        raise _shard_error(index, name, shards, e) from None


def _byte_range(tensor: torch.Tensor, key: str, offset: int, nbytes: int, path: str = "") -> torch.Tensor:
    """Bytes ``[offset, offset + nbytes)`` of a row-major tensor, as a view of its memory.

    Raises:
        FormatError: the tensor is not row-major (contiguous).
        ValueError: the range lies outside it.
    """
    import torch

    size = tensor.numel() * tensor.element_size()
    if not tensor.is_contiguous():
        raise FormatError(f"{path + ': ' if path else ''}key {key!r}: not row-major (strides "
                          f"{tuple(tensor.stride())}): it cannot be read in byte ranges")
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"key {key!r}: bytes {offset}:{offset + nbytes} lie outside its {size} bytes")
    return tensor.reshape(-1).view(torch.uint8)[offset:offset + nbytes]


def _hf_weight_map(path: str) -> dict[str, str]:
    from ..system.files import open_input

    try:
        with open_input(path) as f:
            index = json.load(f)
        shards = index["weight_map"]
        if not isinstance(shards, dict) or not all(isinstance(v, str) for v in shards.values()):
            raise TypeError("weight_map is not {key: file name}")
    except (ValueError, KeyError, TypeError) as e:
        raise FormatError(f"{path}: not a Hugging Face safetensors index: {type(e).__name__}: {e}") from None
    for name in sorted(set(shards.values())):
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise CheckpointFileError(None, f"{path}: shard name {name!r} (for {_keys_of(name, shards)}) is not "
                                            "a file name in the index's folder "
                                            f"{os.path.dirname(path) or '.'} (a checkpoint is read only from its "
                                            "own folder)", name)
    return shards


def _archive_byteorder(path: str) -> str:
    """The byte order a ``torch.save`` archive records (``<archive>/byteorder``;
    little when absent, as ``torch.load`` assumes); "unknown" if unreadable."""
    import zipfile

    from ..system.files import open_input

    try:
        with open_input(path) as f, zipfile.ZipFile(f) as archive:
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
        OSError: the file cannot be opened or read (permission), naming it.
    """

    kind = "torch"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        import torch

        loaded: list[object] = []
        try:
            self._opened = _opened(path, lambda name: loaded.append(
                torch.load(name, mmap=True, weights_only=True, map_location="cpu")))
        except IntegrityError:
            raise
        except Exception as e:  # any other failure of torch.load is reported as FormatError
            if _unreadable(e, path) is not None:  # cannot be read: not a bad file
                raise
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

    def range_source(self, key: str, offset: int, nbytes: int) -> Source:
        return _mapped_source(_byte_range(self.tensor(key), key, offset, nbytes, self.path),
                              f"{self.path}: key {key!r} bytes {offset}:{offset + nbytes}", self._opened,
                              read_file=self._native)

    def _source(self, key: str) -> Source:
        tensor = self._tensors[key]
        if 0 in tensor.stride() and not tensor.is_contiguous():
            return _expanded_source(tensor, f"{self.path}: key {key!r}")
        # torch.load byte-swaps (in its private mapping) an archive saved with the
        # other byte order: then only the mapping has the bytes to write.
        return _mapped_source(tensor, f"{self.path}: key {key!r}", self._opened, read_file=self._native)

    def _mapped(self) -> dict[str, torch.Tensor]:
        return self._tensors

    def close(self) -> None:
        self._tensors = {}
