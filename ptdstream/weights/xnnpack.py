"""XNNPACK with tagged external weights: new weights where XNNPACK stored the bytes
as they are, the new ``.pte`` and ``.ptd`` files byte-identical to a re-export's.

What executorch 1.5.1's XNNPACK does (``backends/xnnpack/operators/node_visitor.py``,
``get_serialized_buffer_index``): every constant it consumes becomes named data
under ``sha256(bytes).hexdigest()`` of the bytes it serializes, alignment 16, no
tensor layout, in the tag of ``delegate_external_constants_pass_unlifted``; the
64-character key is written once into the XNNPACK flatbuffer in the ``.pte``
(``ConstantDataOffset.named_key``). The bytes are the weight's own unless it is
statically quantized, 4-bit packed, an NHWC or depthwise/transposed conv
weight, or of a dtype other than fp16/bf16 (cast to fp32); quant scales are
stored as ``scale_<sha256>``.

So a key whose bytes are exactly one tensor of the old checkpoint was stored
untransformed, and the re-export with new weights stores the new tensor's bytes
under its own SHA-256: the new ``.pte`` is the old one with each such key
replaced (same length) at every place it occurs: a weight shared by several
methods (prefill and decode) is named once in each method's delegate blob, and
the re-export names the new key in each. The ``.ptd`` holds the new bytes under
the new keys in the same order. Any other key (transformed bytes, a scale, a
key the ``.pte`` never names, old tensors equal where new ones differ) is
refused by name.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

from ..sources import BufferRing, FileRangeSource
from ..system.files import open_input

__all__ = ["XNNPACK_ALIGNMENT", "XNNPACK_ID", "delegates_all_xnnpack", "find_all", "match_keys",
           "rewritten_program_plan"]

XNNPACK_ID = "XnnpackBackend"
#: ``backends/xnnpack/serialization/xnnpack_graph_serialize.py::CONSTANT_TENSOR_ALIGNMENT``.
XNNPACK_ALIGNMENT = 16
_SCAN_NBYTES = 8 << 20


def sha256_of(source, ring: BufferRing) -> str:
    """Hex SHA-256 of a source's bytes, streamed."""
    h = hashlib.sha256()
    for piece in source.pieces(ring):
        h.update(piece)
    return h.hexdigest()


def match_keys(xnn_keys: list[str], old, new, problems: list[str],
               lookup: Callable[[str], str | None] | None = None) -> dict[str, tuple[str, str]]:
    """``{old XNNPACK key: (new checkpoint's key, new XNNPACK key)}``; problems appended.

    ``old`` and ``new`` are open checkpoints (the old weights, exported, and the
    new ones). A tensor named ``n`` in ``old`` is ``n`` in ``new`` when ``new``
    has that key, else ``lookup(n)`` (``write_ptd``'s ``key_map``: ``old`` named
    as the program's FQNs, ``new`` by another prefix).
    """
    ring = BufferRing(count=1)
    wanted = set(xnn_keys)
    by_digest: dict[str, list[str]] = {}
    for key, entry in old.entries.items():
        if entry.nbytes:
            digest = sha256_of(old.source(key), ring)
            if digest in wanted:
                by_digest.setdefault(digest, []).append(key)
    out: dict[str, tuple[str, str]] = {}
    new_keys: dict[str, str] = {}
    for xkey in xnn_keys:
        if xkey.startswith("scale_"):
            problems.append(f"XNNPACK key {xkey!r}: a quantization scale (its weight is quantized by XNNPACK); "
                            "re-export")
            continue
        names = by_digest.get(xkey)
        if not names:
            problems.append(f"XNNPACK key {xkey!r}: no tensor of {old.path} has these bytes: XNNPACK "
                            "transformed them (quantized, 4-bit packed, NHWC or swapped conv weight, cast to "
                            "fp32); re-export (or, for a constant that is no trained weight, such as a "
                            f"non-persistent buffer: keep=[{xkey!r}] / --keep {xkey} keeps its exported bytes)")
            continue
        renamed = {n: n if n in new.entries or lookup is None else (lookup(n) or n) for n in names}
        missing = [n for n in names if renamed[n] not in new.entries]
        if missing:
            shown = missing[0] if renamed[missing[0]] == missing[0] else f"{missing[0]} -> {renamed[missing[0]]}"
            problems.append(f"XNNPACK key {xkey!r}: {shown!r} is not in {new.path}")
            continue
        bad = [n for n in names if (new.entries[renamed[n]].dtype, new.entries[renamed[n]].shape) !=
               (old.entries[n].dtype, old.entries[n].shape)]
        if bad:
            problems.append(f"XNNPACK key {xkey!r}: {bad[0]!r} changed dtype or shape between the checkpoints")
            continue
        names = [renamed[n] for n in names]
        digests = {sha256_of(new.source(n), ring) for n in names}
        if len(digests) != 1:
            problems.append(f"XNNPACK key {xkey!r}: {names} were equal in {old.path} and differ in {new.path}: "
                            "the re-export would store them under several keys; re-export")
            continue
        new_key = digests.pop()
        if new_key in new_keys:
            problems.append(f"XNNPACK keys {new_keys[new_key]!r} and {xkey!r} hold equal bytes in {new.path}: "
                            "the re-export would store them under one key; re-export")
            continue
        new_keys[new_key] = xkey
        out[xkey] = (names[0], new_key)
    return out


def find_all(path: str, keys: list[str], problems: list[str]) -> dict[str, list[int]]:
    """``{key: [file offset, ...]}`` of every ASCII occurrence of each key in the file
    at ``path`` (read in 8 MiB pieces), ascending; a key found nowhere is a problem.
    A 64-character SHA-256 hex digest occurs in a ``.pte`` only where a delegate
    blob names it (once per method that uses the weight)."""
    positions: dict[str, set] = {k: set() for k in keys}
    needles = [(k, k.encode()) for k in keys]
    overlap = max((len(k) for k in keys), default=1) - 1
    with open_input(path) as f:
        offset, tail = 0, b""
        while True:
            block = f.read(_SCAN_NBYTES)
            if not block:
                break
            window = tail + block
            base = offset - len(tail)
            for key, needle in needles:
                at = window.find(needle)
                while at != -1:
                    positions[key].add(base + at)
                    at = window.find(needle, at + 1)
            offset += len(block)
            tail = window[-overlap:] if overlap else b""
    out = {}
    for key, places in positions.items():
        if not places:
            problems.append(f"XNNPACK key {key!r} of the like= files is nowhere in {path}: that .ptd is not "
                            "from this program's export; pass the .ptd files written with it")
        else:
            out[key] = sorted(places)
    return out


def rewritten_program_plan(path: str, replacements: dict[int, tuple[str, str]], name: str):
    """A ``FilePlan`` of the ``.pte`` at ``path`` with the key at each offset replaced
    (``{offset: (old key, new key)}``, equal lengths): the file's own bytes
    streamed around the new keys."""
    from ..format.plan import Extent, FilePlan

    nbytes = os.path.getsize(path)
    extents = []
    position = 0
    for offset in sorted(replacements):
        old_key, new_key = replacements[offset]
        if offset > position:
            extents.append(Extent.payload(FileRangeSource(path, position, offset - position), "program"))
        extents.append(Extent.metadata(new_key.encode(), f"XNNPACK key (was {old_key[:12]}...)"))
        position = offset + len(old_key)
    if position < nbytes:
        extents.append(Extent.payload(FileRangeSource(path, position, nbytes - position), "program"))
    return FilePlan("pte", name, tuple(extents), nbytes, 0, (), 0)


def delegates_all_xnnpack(delegates: list[tuple[str, str]]) -> bool | None:
    """True when every delegate is XNNPACK, None when there is none."""
    if not delegates:
        return None
    return all(backend == XNNPACK_ID for _, backend in delegates)
