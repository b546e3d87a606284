"""The only package that touches executorch's (and torch's) internals.

Two halves. The door, imported by every layer, imports nothing of ptdstream:
``names`` (the registry of private names, checked against each release),
``adapter`` (one accessor per private name), ``patching`` (the one scoped,
thread-safe patching mechanism) and ``untrusted`` (bounded parsing of untrusted
program flatbuffers into executorch's dataclasses, for ``weights``; the readers of
:mod:`ptdstream.format` need no executorch). The integrations, which sit on top of ``save``: ``interop``
(``FileBackedData`` over any source), ``emitter`` (constants by reference),
``blobs`` (delegate blobs that stay in files), ``cuda_backend`` (the CUDA
backend's weights) and ``install`` (the drop-in for executorch's save methods).
"""
