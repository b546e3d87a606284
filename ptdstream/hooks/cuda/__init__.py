"""The CUDA backend's weights: ``backend`` (:func:`stream_cuda_weights`), ``twins``
(held parameters with equal bytes) and ``spill`` (storages the GPU cannot keep
until the save, in an unlinked temp file)."""

__all__: list = []
