"""Integrity manifests: a content check of a saved set at disk speed, in bounded memory.

A manifest (``schema/manifest.fbs``, identifier ``PSM1``) lists, for each file: its
name (no folder), kind, size, every section (from :mod:`ptdstream.format.reader`), the
xxh3-128 digest of every fixed-size piece (8 MiB by default; the last may be
shorter) and, for each named-data key, the xxh3-128 fingerprint of its bytes.
Its bytes depend only on the files it describes: files are listed in the order
given, sections in file order, keys in the file's key order.

``write_manifest`` reads each file once. :func:`verify_manifest` reads each file
once and names the first bad piece, the 4 KiB block and section where the first
difference lies, and every section and key whose bytes differ
(:mod:`ptdstream.check.manifest_narrow`; version 2 manifests).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import xxhash

from ..defaults import CHUNK_NBYTES
from ..errors import FormatError
from ..format.fb_roots import shown
from ..format.reader import read_artifact
from ..reports import Report
from ..sources import BufferRing, FileRangeSource
from ..write.sink import ChunkedFileSink
from .manifest_codec import (  # noqa: F401 - the manifest's data and bytes, re-exported
    ALGORITHM,
    IDENTIFIER,
    MIN_PIECE_NBYTES,
    FileManifest,
    IntegrityManifest,
    SectionEntry,
    from_bytes,
    to_bytes,
)
from .manifest_narrow import (
    BLOCK_NBYTES,
    RangeDigester,
    bad_keys_of,
    differing_sections,
    locate,
)
from .manifest_narrow import (
    key_ranges as manifest_key_ranges,
)

__all__ = [
    "IDENTIFIER",
    "FileManifest",
    "IntegrityManifest",
    "SectionEntry",
    "describe_file",
    "from_bytes",
    "manifest_path_for",
    "manifest_sink",
    "read_manifest",
    "to_bytes",
    "verify_files",
    "verify_manifest",
    "write_manifest",
    "write_manifest_report",
]

#: File name suffix of a manifest.
SUFFIX = ".manifest"


def manifest_path_for(path: str) -> str:
    """The default manifest of a set whose first file is ``path``: the same path
    with its suffix replaced by ``.manifest`` (``out/model.pte`` -> ``out/model.manifest``)."""
    return os.path.splitext(os.fspath(path))[0] + SUFFIX


def piece_digests(source: FileRangeSource, piece_nbytes: int, digester: RangeDigester) -> list[bytes]:
    """The xxh3-128 digest of every ``piece_nbytes`` piece of ``source`` (the last
    may be shorter), feeding ``digester`` the same single read (and finishing it).

    The file is read in reads of at most ``CHUNK_NBYTES`` (one buffer of that
    size, or of ``piece_nbytes`` when smaller), whatever the piece size: a
    manifest's piece size is read from the manifest, so it never sizes a buffer.
    """
    return list(iter_piece_digests(source, piece_nbytes, digester))


def iter_piece_digests(source: FileRangeSource, piece_nbytes: int, digester: RangeDigester) -> Iterator[bytes]:
    """:func:`piece_digests` one at a time: a verify keeps none of them (the file
    may be larger than its manifest says)."""
    hasher, filled = xxhash.xxh3_128(), 0
    for read in source.pieces(BufferRing(min(piece_nbytes, CHUNK_NBYTES), count=1)):
        digester.update(read)
        view = memoryview(read)
        while len(view):
            n = min(len(view), piece_nbytes - filled)
            hasher.update(view[:n])
            view, filled = view[n:], filled + n
            if filled == piece_nbytes:
                yield hasher.digest()
                hasher, filled = xxhash.xxh3_128(), 0
    if filled:
        yield hasher.digest()
    digester.finish()


def describe_file(path: str, piece_nbytes: int = CHUNK_NBYTES, name: str | None = None) -> FileManifest:
    """Read ``path`` once and describe it under ``name`` (default: its base name; a
    save describes its synced temp files under their targets' names). Non-ExecuTorch files get pieces only.

    Raises:
        ValueError: ``piece_nbytes`` below ``MIN_PIECE_NBYTES`` (4096; a manifest
            with smaller pieces is refused when read).
        OSError: the file cannot be read.
        IntegrityError: the file shrank while it was read.
    """
    if piece_nbytes < MIN_PIECE_NBYTES:
        raise ValueError(f"{path}: piece size {piece_nbytes} is below the {MIN_PIECE_NBYTES} bytes a manifest "
                         "piece may have")
    try:
        artifact = read_artifact(path)
        kind = artifact.kind
        sections = tuple(
            SectionEntry(s.name, s.key, s.start, s.end - s.start) for s in artifact.sections()
        )
        key_ranges = [
            (key, artifact.segments[index].start, artifact.segments[index].end)
            for key, index in artifact.keys.items()
        ]
    except FormatError:
        kind, sections, key_ranges = "file", (), []
    source = FileRangeSource(path)  # reads in pieces, drops the pages behind it
    digester = RangeDigester([(s.offset, s.offset + s.nbytes) for s in sections]
                             + [(start, end) for _, start, end in key_ranges])
    pieces = piece_digests(source, piece_nbytes, digester)
    keys = tuple((key, end - start, digester.digest(start, end)) for key, start, end in key_ranges)
    sections = tuple(SectionEntry(s.name, s.key, s.offset, s.nbytes, digester.digest(s.offset, s.offset + s.nbytes))
                     for s in sections)
    return FileManifest(os.path.basename(path) if name is None else name, kind, source.nbytes, piece_nbytes,
                        tuple(pieces), sections,
                        keys,  # type: ignore[arg-type]  # a digest is None only for a range the file no longer holds
                        BLOCK_NBYTES, tuple(digester.blocks))


def manifest_sink(files: Sequence[tuple[str, str]], out_path: str,
                  piece_nbytes: int = CHUNK_NBYTES) -> ChunkedFileSink:
    """A synced, unpublished sink for ``out_path`` holding the manifest of
    ``[(path to read, name to record)]``: a save describes its synced temp files
    under their targets' names and publishes the manifest in the same set
    (whose writer ran the folder step for ``out_path``'s folder: the sink skips it).

    Raises:
        OSError, IntegrityError: as :func:`describe_file` (the sink is aborted).
    """
    sink = ChunkedFileSink(out_path, clean_folder=False)
    try:
        manifest = IntegrityManifest(tuple(describe_file(p, piece_nbytes, name) for p, name in files))
        sink.write(to_bytes(manifest))
        sink.sync()
    except BaseException:
        sink.abort()
        raise
    return sink


def write_manifest(paths: Sequence[str], out_path: str, piece_nbytes: int = CHUNK_NBYTES) -> IntegrityManifest:
    """Describe ``paths`` and write the manifest atomically to ``out_path``."""
    manifest = IntegrityManifest(tuple(describe_file(p, piece_nbytes) for p in paths))
    with ChunkedFileSink(out_path) as sink:
        sink.write(to_bytes(manifest))
    return manifest


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
        return all(c.ok for c in self.checks)

    def summary(self) -> str:
        return "\n".join(c.summary() for c in self.checks)


@dataclass(frozen=True)
class ManifestWritten(Report):
    """A manifest written by :func:`write_manifest_report`: where, and what it covers."""

    path: str
    files: int
    pieces: int
    keys: int

    def summary(self) -> str:
        return f"wrote {self.path}: {self.files} file(s), {self.pieces} piece(s), {self.keys} key(s)"


def write_manifest_report(paths: Sequence[str], out_path: str,
                          piece_nbytes: int = CHUNK_NBYTES) -> ManifestWritten:
    """:func:`write_manifest`, returning a report."""
    manifest = write_manifest(paths, out_path, piece_nbytes)
    return ManifestWritten(out_path, len(manifest.files), sum(len(f.pieces) for f in manifest.files),
                           sum(len(f.keys) for f in manifest.files))


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
    (:mod:`ptdstream.check.manifest_narrow`).

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
    parts = [f"{path}: first bad piece {bad} at offset {(bad or 0) * entry.piece_nbytes}" if bad is not None
             else f"{path}: keys"]
    if offset is not None and span is not None:
        parts.append(f"differs in bytes [{offset:,}, {offset + span:,})")
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
    with open(path, "rb") as f:
        return from_bytes(f.read(), path)
