"""The hooks: ptdstream inside upstream's export, the mechanisms the ways in share.

``interop`` (``FileBackedData`` over any source), ``emitter`` (constants by
reference), ``xnnpack`` (XNNPACK's constants by reference), ``xnnpack_qc4w`` (its 4-bit
packing of a large weight in bands, into a file), ``reachability`` (the
partitioners' closure sets as bitsets), ``blobs`` (delegate blobs that stay in
files), ``fx_sources`` (generated graph sources freed with their code),
``program_caches`` (upstream's references to finished programs dropped),
``install`` (the drop-in for executorch's save methods) and ``cuda/`` (the CUDA
backend's weights: ``backend``, the context; ``routing``, the collector's calls;
``keeping``, where each storage's bytes stay; and their mechanisms). They patch
only through :mod:`ptdstream.upstream.patching` and reach private names only
through :mod:`ptdstream.upstream`.

Who imports them: the ways in above (``weightless/``: the emitter, fx sources, program caches and
the CUDA backend's sharing; ``hf/``: install, the emitter and XNNPACK's constants
by reference) and the package root (``ptdstream.install``,
``constants_by_reference``, ...); no pipeline stage below does.
"""

__all__: list = []
