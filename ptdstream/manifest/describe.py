"""Writing an integrity manifest: each file of a set described once, as it is read.

A manifest (``schema/manifest.fbs``, identifier ``PSM1``) lists, for each file: its
name (no folder), kind, size, every section (from :mod:`ptdstream.format.reader`), the
xxh3-128 digest of every fixed-size piece (8 MiB by default; the last may be
shorter) and, for each named-data key, the xxh3-128 fingerprint of its bytes.
Its bytes depend only on the files it describes: files are listed in the order
given, sections in file order, keys in the file's key order.

:func:`write_manifest` reads each file once; a save's manifest joins its set
(:func:`manifest_sink`). Checking one: :mod:`ptdstream.manifest.verify`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

from ..defaults import CHUNK_NBYTES
from ..errors import FormatError
from ..format.reader import read_artifact
from ..reports import Report
from ..sources import BufferRing, FileRangeSource
from ..write.sink import ChunkedFileSink
from .codec import FileManifest, IntegrityManifest, SectionEntry, to_bytes
from .naming import MIN_PIECE_NBYTES, manifest_path_for
from .narrow import BLOCK_NBYTES, RangeDigester

__all__ = ["ManifestWritten", "describe_file", "iter_piece_digests", "manifest_path_for", "manifest_sink",
           "piece_digests", "write_manifest", "write_manifest_report"]


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
