"""Compressed transport in the seekable zstd format.

``seek_table`` (the format: seek table, content frame, frame extents) ->
``seekable`` (random-access, checked reader) -> ``compress`` (``pack``),
``decompress`` (``unpack``) and ``extract`` (one key or segment).
"""

from .compress import PackReport, artifact_head, pack, plan_frames
from .decompress import UnpackReport, unpack
from .extract import ExtractReport, PackedArtifact

__all__ = ["ExtractReport", "PackReport", "PackedArtifact", "UnpackReport", "artifact_head", "pack",
           "plan_frames", "unpack"]
