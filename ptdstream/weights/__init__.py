"""New weights for an exported program: the ``.ptd`` files it loads, straight from a
checkpoint, without re-exporting (``ptdstream weights``, :func:`write_ptd`).

``write`` plans and writes the files (:func:`write_ptd`, its spine of named
steps); ``check`` checks a checkpoint against the program's external weights
(every problem with the option that resolves it); ``xnnpack`` handles XNNPACK's
tagged external weights (keys that are SHA-256 digests of the bytes it stores,
and the new ``.pte`` that names them).
"""

from .write import DEFAULT_TAG, WeightsReport, read_program_weights, write_ptd

__all__ = ["DEFAULT_TAG", "WeightsReport", "read_program_weights", "write_ptd"]
