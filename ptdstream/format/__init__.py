"""Plan and read back: the .pte and .ptd formats, byte for byte.

``identity`` (magics, versions, headers) -> ``layout`` (alignment and placement
rules, both formats) -> ``plan`` (frozen plans) -> ``pte`` / ``ptd`` (planners) and
``artifact`` -> ``pte_reader`` / ``ptd_reader`` -> ``reader`` (read back).
"""
