"""Compressed transport in the seekable zstd format.

``seek_table`` (the format: seek table, content frame, frame extents) ->
``seekable`` (random-access, checked reader) -> ``compress`` (``pack``),
``decompress`` (``unpack``) and ``extract`` (one key or segment).

Not pyzstd's ``SeekableZstdFile``, though each reads the other's files: its
writer stores no seek table checksums, no content size in a frame header and no
content frame (the bytes would change, and unpack would lose two of its three
checks); its reader checks no seek table checksum and holds the skipped bytes
when it seeks inside a frame.
"""

from .compress import PackReport, artifact_head, pack, plan_frames
from .decompress import UnpackReport, unpack
from .extract import ExtractReport, PackedArtifact

__all__ = ["ExtractReport", "PackReport", "PackedArtifact", "UnpackReport", "artifact_head", "pack",
           "plan_frames", "unpack"]
