"""The hooks: ptdstream inside upstream's export, on top of every other layer.

Nothing else in the package imports them (the CLI and the package root call them).
``interop`` (``FileBackedData`` over any source), ``emitter`` (constants by
reference), ``xnnpack`` (XNNPACK's constants by reference), ``blobs`` (delegate
blobs that stay in files), ``reachability`` (the partitioners' closure sets as
bitsets), ``fx_sources`` (generated graph sources freed with their code),
``install`` (the drop-in for executorch's save methods), ``optimum``
(optimum-executorch with ptdstream saving) and ``cuda`` (the CUDA backend's
weights: ``backend``, ``twins``, ``spill``). They patch only through
:mod:`ptdstream.upstream.patching` and reach private names only through
:mod:`ptdstream.upstream`.
"""

__all__: list = []
