"""Read one key or segment of a packed .pte/.ptd without unpacking the rest:
:class:`PackedArtifact` decompresses only the frames of the metadata head and of
the segment asked for."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

from ..errors import FormatError, MissingKeyError
from ..format.artifact import Artifact, Segment
from ..format.reader import parse_artifact
from ..reports import Report
from ..write.sink import ChunkedFileSink
from .seek_table import MAX_FRAME_NBYTES
from .seekable import SeekableReader

__all__ = ["ExtractReport", "PackedArtifact"]


@dataclass(frozen=True)
class ExtractReport(Report):
    """One extracted range: ``what`` ("key 'w'" / "segment 3"), its content
    ``offset``/``nbytes``, frames decompressed out of the file's total."""

    source: str
    target: str | None
    what: str
    offset: int
    nbytes: int
    frames_decoded: int
    frames_total: int

    def summary(self) -> str:
        return (f"extracted {self.what} ({self.nbytes:,} bytes at offset {self.offset:,}) from {self.source} -> "
                f"{self.target or 'stdout'}: decompressed {self.frames_decoded} of {self.frames_total} frames")


#: The most metadata (header + program flatbuffer, or FlatTensor head) a packed
#: artifact may make :class:`PackedArtifact` read: 256 MiB. Programs with segments
#: keep their flatbuffer far smaller; only a .pte with its constants inline (no
#: extended header) can come near it.
MAX_METADATA_NBYTES = 256 << 20


class PackedArtifact:
    """A packed .pte/.ptd, read without unpacking it.

    Calls: 1) the constructor opens the packed file and parses the section map
    (:class:`~ptdstream.format.artifact.Artifact`) from the frames covering the metadata
    only; 2) :meth:`segment`, :meth:`read`, :meth:`extract`;
    3) :meth:`close` (or leave the ``with``). Memory: one frame plus the metadata.
    Not thread-safe.

    Raises:
        FormatError: the packed file, or the .pte/.ptd in it, is invalid.
        IntegrityError: a frame read fails its checks.
        MissingKeyError: an unknown key or segment index.
        OSError: the file cannot be read.
    """

    def __init__(self, path: str, *, max_frame_nbytes: int = MAX_FRAME_NBYTES,
                 max_metadata_nbytes: int = MAX_METADATA_NBYTES) -> None:
        self.reader = SeekableReader(path, max_frame_nbytes=max_frame_nbytes, drop_pages=False)
        name = f"{self.reader.path} (decompressed)"

        def read_metadata(offset: int, nbytes: int) -> bytes:
            # The header's claims are checked against what the seek table says
            # exists; this bounds what a claim that does exist (zeros compress
            # to nothing) can make the reader allocate.
            if nbytes > max_metadata_nbytes:
                raise FormatError(f"{name}: metadata of {nbytes:,} bytes at offset {offset:,} is over the "
                                  f"limit of {max_metadata_nbytes:,} bytes for a packed artifact (its header "
                                  "claims a program that large); unpack it, or raise max_metadata_nbytes")
            return self.reader.read_at(offset, nbytes)

        try:
            self.artifact: Artifact = parse_artifact(name, self.reader.nbytes, read_metadata)
        except BaseException:
            self.reader.close()
            raise

    def segment(self, key: str | None = None, index: int | None = None) -> Segment:
        """The segment holding named-data ``key``, or segment number ``index``."""
        art = self.artifact
        if key is not None:
            found = art.keys.get(key)
            if found is None:
                names = ", ".join(repr(k) for k in list(art.keys)[:5]) or "none"
                raise MissingKeyError(f"{self.reader.path}: no key {key!r}; it has {len(art.keys)} keys "
                                      f"({names}{', ...' if len(art.keys) > 5 else ''}); list them with --list")
            return art.segments[found]
        if index is None or not 0 <= index < len(art.segments):
            raise MissingKeyError(f"{self.reader.path}: no segment {index}; it has {len(art.segments)} segments")
        return art.segments[index]

    def read(self, key: str | None = None, index: int | None = None) -> bytes:
        """The bytes of named-data ``key`` or of segment ``index`` (allocates their size)."""
        seg = self.segment(key, index)
        return self.reader.read_at(seg.start, seg.nbytes)

    def extract(self, target: str | None, key: str | None = None, index: int | None = None,
                stream=None) -> ExtractReport:
        """Stream the segment to the file ``target`` (published atomically) or, when
        None, to the binary ``stream`` (default stdout); one frame in memory at a time."""
        seg = self.segment(key, index)
        before = self.reader.frames_decoded
        with (ChunkedFileSink(target) if target is not None
              else contextlib.nullcontext(stream or sys.stdout.buffer)) as out:
            for piece in self.reader.iter_range(seg.start, seg.nbytes):
                out.write(piece)
        what = f"key {key!r}" if key is not None else f"segment {seg.index}"
        return ExtractReport(self.reader.path, target, what, seg.start, seg.nbytes,
                             self.reader.frames_decoded - before, sum(1 for f in self.reader.table.frames if f.nbytes))

    def close(self) -> None:
        """Close the packed file (idempotent)."""
        self.reader.close()

    def __enter__(self) -> PackedArtifact:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
