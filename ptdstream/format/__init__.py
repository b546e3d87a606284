"""Plan and read back: the .pte and .ptd formats, byte for byte.

``identity`` (magics, versions, headers) -> ``layout`` (alignment and placement
rules, both formats) -> ``plan`` (frozen plans) -> ``pte`` / ``ptd`` (planners) and
``artifact`` -> ``pte_reader`` / ``ptd_reader`` -> ``reader`` (read back).

The readers need no torch nor executorch: ``program_fb/``, ``flat_tensor_fb/`` (flatc
code) and ``fb_tables.py`` are generated from executorch's installed schemas by
``tools/gen_format_schema.sh``; ``verifier`` checks a buffer the way the runtime's
C++ ``flatbuffers::Verifier`` does before ``fb_roots`` hands it to the flatc code.
"""

__all__: list[str] = []
