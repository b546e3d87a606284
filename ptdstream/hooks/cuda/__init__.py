"""The CUDA backend's weights, through :func:`~ptdstream.hooks.cuda.backend.stream_cuda_weights`.

* ``backend``: the context (:func:`stream_cuda_weights`): what upstream's
  collector does and what ptdstream does instead;
* ``routing``: ``CudaWeightStream``, its patches in the collector and the
  collector's calls answered with sources;
* ``keeping``: where each storage's bytes stay until the save, and the stats;
* the mechanisms it keeps them with: ``sharing`` (one copy of the weights
  through the lowering of every method), ``hosted`` (a device copy served from
  its host weight), ``twins`` (held parameters with equal bytes), ``spill``
  (storages the GPU cannot keep until the save, in an unlinked temp file) and
  ``trim`` (the host heap handed back after each method).
"""

__all__: list = []
