"""Checking files against an integrity manifest: each file read once, the first
difference narrowed to its piece, 4 KiB block and section, and every section and
key whose bytes differ named (:mod:`ptdstream.manifest.narrow`; version 2 manifests).
``ptdstream verify --manifest`` runs :func:`verify_files`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..format.fb_roots import shown
from ..reports import Report
from ..sources import FileRangeSource
from ..system.files import open_input
from .codec import IntegrityManifest, from_bytes
from .describe import iter_piece_digests
from .narrow import RangeDigester, bad_keys_of, differing_sections, locate
from .narrow import key_ranges as manifest_key_ranges

__all__ = ["ManifestCheck", "ManifestReport", "read_manifest", "verify_files", "verify_manifest"]


@dataclass(frozen=True)
class ManifestCheck(Report):
    """Result of checking one file against its manifest entry.

    ``first_bad_piece`` is the index of the first bad piece; ``first_bad_offset`` the
    file offset (bytes) the first difference was narrowed to (``bad_nbytes`` long):
    inside the first differing 4 KiB block and section (version >= 2 manifests), else
    the bad piece, or where the size differs. ``section``/``key`` name the manifest
    section there; ``bad_sections`` lists every section whose bytes differ as ``(name,
    key, offset, nbytes)``; ``bad_keys`` every key whose bytes differ. The ranges are
    the ones the manifest recorded, so a cut file reports only what it lost.
    """

    path: str
    ok: bool
    message: str
    first_bad_piece: int | None = None
    first_bad_offset: int | None = None
    section: str | None = None
    key: str | None = None
    bad_keys: tuple[str, ...] = field(default=())
    bad_sections: tuple[tuple[str, str | None, int, int], ...] = field(default=())
    bad_nbytes: int | None = None

    def summary(self) -> str:
        return ("OK " if self.ok else "BAD ") + self.message


@dataclass(frozen=True)
class ManifestReport(Report):
    """Every file checked against one manifest; ``ok`` when all match."""

    manifest_path: str
    checks: tuple[ManifestCheck, ...]

    derived = ("ok",)

    @property
    def ok(self) -> bool:
        """Whether every file matched the manifest."""
        return all(c.ok for c in self.checks)

    def summary(self) -> str:
        return "\n".join(c.summary() for c in self.checks)


def verify_files(paths: Sequence[str], manifest_path: str) -> ManifestReport:
    """Check each of ``paths`` against the manifest at ``manifest_path``.

    Raises:
        FormatError: the manifest does not parse.
        OSError: the manifest or a file cannot be read.
    """
    manifest = read_manifest(manifest_path)
    return ManifestReport(manifest_path, tuple(verify_manifest(p, manifest) for p in paths))


def verify_manifest(path: str, manifest: IntegrityManifest) -> ManifestCheck:
    """Check ``path`` against the entry of the same name in ``manifest``.

    Reads the file once, in the manifest's piece size (bounded memory), digesting the
    sections and keys at the offsets the manifest recorded
    (:mod:`ptdstream.manifest.narrow`).

    Raises:
        OSError: the file cannot be read.
    """
    name = os.path.basename(path)
    entry = next((f for f in manifest.files if f.name == name), None)
    if entry is None:
        return ManifestCheck(path, False, f"{path}: the manifest has no entry named {shown(name, True)}")
    ranges = manifest_key_ranges(entry.sections, entry.keys)
    digester = RangeDigester([(s.offset, s.offset + s.nbytes) for s in entry.sections] + list(ranges.values()),
                             entry.block_nbytes)
    source = FileRangeSource(path)
    bad, count = None, 0
    for count, got in enumerate(iter_piece_digests(source, entry.piece_nbytes, digester), 1):
        if bad is None and (count > len(entry.pieces) or entry.pieces[count - 1] != got):
            bad = count - 1
    if bad is None and len(entry.pieces) != count:
        bad = min(len(entry.pieces), count)
    bad_keys = bad_keys_of(path, entry, ranges, digester)
    bad_sections = differing_sections(entry.sections, digester)
    if bad is None and source.nbytes == entry.nbytes and not bad_keys and not bad_sections:
        return ManifestCheck(path, True, f"{path}: matches the manifest ({entry.nbytes:,} bytes, {len(entry.pieces)} "
            f"piece{'s' if len(entry.pieces) != 1 else ''})")
    offset, span, section = locate(entry, bad, digester, source.nbytes, bad_sections, bad_keys)
    piece = ""
    if bad is not None:  # the piece is where the digests first differ, not the differing bytes
        start = bad * entry.piece_nbytes
        end = max(min(start + entry.piece_nbytes, max(entry.nbytes, source.nbytes)), start)
        piece = f"piece {bad}, bytes [{start:,}, {end:,})"
    if offset is not None and span is not None:
        parts = [f"{path}: differs in bytes [{offset:,}, {offset + span:,})" + (f" (first bad {piece})" if piece
                                                                                 else "")]
    else:
        parts = [f"{path}: first bad {piece}" if piece else f"{path}: keys"]
    if section is not None:
        parts.append(f"section {shown(section.name, True)} at {section.offset:,} ({section.nbytes:,} bytes)"
                     + (f", key {shown(section.key, True)}" if section.key else ""))
    if bad_sections:
        parts.append("sections differing: " + ", ".join(f"{shown(s.name, True)}@{s.offset}" for s in bad_sections[:5])
                     + (f" and {len(bad_sections) - 5} more" if len(bad_sections) > 5 else ""))
    if source.nbytes != entry.nbytes:
        parts.append(f"size {source.nbytes} != {entry.nbytes}")
    if bad_keys:
        parts.append(f"keys differing: {', '.join(shown(k, True) for k in bad_keys[:5])}"
                     + (f" and {len(bad_keys) - 5} more" if len(bad_keys) > 5 else ""))
    return ManifestCheck(
        path, False, "; ".join(parts), bad, offset, section.name if section else None,
        section.key if section else None, bad_keys,
        tuple((s.name, s.key, s.offset, s.nbytes) for s in bad_sections), span,
    )


def read_manifest(path: str) -> IntegrityManifest:
    """Read and parse a manifest file (it is small: metadata only)."""
    with open_input(path) as f:
        return from_bytes(f.read(), path)
