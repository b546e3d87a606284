"""Sizes every stage shares: the piece and the page-drop window.

One piece size runs through ptdstream: sources are read, digested and written in
pieces of :data:`CHUNK_NBYTES`; ``pack`` compresses frames of that size; manifests
digest pieces of that size. A piece is the unit of bounded memory: a save holds a
few pieces (the ring), never a whole tensor.
"""

__all__ = ["CHUNK_NBYTES", "WINDOW_NBYTES"]

#: Bytes per piece (8 MiB).
CHUNK_NBYTES = 8 << 20

#: Bytes written to an output file between page-cache drops (64 MiB).
WINDOW_NBYTES = 64 << 20
