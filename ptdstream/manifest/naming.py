"""What a command line checks of a manifest before the readers are imported: the
default manifest path of a set and the smallest piece size (no flatbuffers, no numpy)."""

from __future__ import annotations

import os

__all__ = ["MIN_PIECE_NBYTES", "SUFFIX", "manifest_path_for"]

#: The suffix of a manifest file.
SUFFIX = ".manifest"
#: The smallest piece size a manifest may give and ptdstream writes (bytes): one
#: block; a digest per fewer bytes would cost more memory and time than the file.
MIN_PIECE_NBYTES = 4096


def manifest_path_for(path: str) -> str:
    """The default manifest of a set whose first file is ``path``: the same path
    with its suffix replaced by ``.manifest`` (``out/model.pte`` -> ``out/model.manifest``)."""
    return os.path.splitext(os.fspath(path))[0] + SUFFIX
