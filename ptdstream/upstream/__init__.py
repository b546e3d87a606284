"""The door to executorch's and torch's internals: the only package that names them.

Imported by every layer, it imports nothing of ptdstream above it: ``names`` (the
registry of private names, checked against each release), ``adapter`` (one
accessor per private name), ``patching`` (the one scoped, thread-safe patching
mechanism) and ``untrusted`` (bounded parsing of untrusted program flatbuffers
into executorch's dataclasses). The readers of :mod:`ptdstream.format` need none
of it.
"""

__all__: list = []
