"""Checkpoints as sources: every tensor of a checkpoint by key, its layout, and its
bytes streamed in pieces, never loaded whole (except DCP, one tensor at a time).

Kinds, each read through its own library:

* ``.safetensors`` file, or a Hugging Face sharded checkpoint
  (``model.safetensors.index.json``, its ``weight_map`` naming each key's shard):
  the header is read and checked by ptdstream (one pass, bounded by its size:
  :func:`~ptdstream.sources.safetensors_header.check_safetensors_header`), the
  file mapped once as ``safetensors.safe_open`` maps it; each tensor is a view of
  that mapping made when its key is first used, whose file range is read piece
  by piece with ``pread``, its pages
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

import os

from ..errors import FormatError
from .checkpoint_base import Checkpoint
from .checkpoint_dcp import DcpCheckpoint
from .checkpoint_mapped import SafetensorsCheckpoint, TorchCheckpoint

__all__ = ["FORMATS", "open_checkpoint"]

#: The file Hugging Face writes beside the shards of a sharded safetensors checkpoint.
HF_INDEX_NAME = "model.safetensors.index.json"
#: The metadata file of a DCP directory (``torch.distributed.checkpoint.filesystem._metadata_fn``).
DCP_METADATA_NAME = ".metadata"
#: The formats :func:`open_checkpoint` takes; ``"auto"`` detects all but ``"dcp"``.
FORMATS = ("auto", "safetensors", "torch", "dcp")


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
            that does not fit ``path``; a checkpoint that reads but is malformed (see each kind).
        CheckpointFileError: a shard a Hugging Face index names that is missing, unreadable or outside its
            folder (one line naming the index, the shard and its keys; an ``OSError`` too).
        OSError: a checkpoint file that cannot be opened or read (permission), naming it.
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
