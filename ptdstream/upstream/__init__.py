"""The door to executorch's and torch's internals: the only package that names them.

Imported by every layer, it imports nothing of ptdstream above it: ``names`` (the
registry of private names, checked against each release), ``adapter`` (one
accessor per private name) and ``patching`` (the one scoped, thread-safe patching
mechanism). Files ptdstream did not write are read by :mod:`ptdstream.format`'s
bounds-checked readers, which need none of it.
"""

__all__: list = []
