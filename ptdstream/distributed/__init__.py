"""Many ranks, one artifact: :func:`write_data_files` called on every rank of a
``torch.distributed`` group writes one set of ``.ptd`` files, each rank writing
only the bytes it holds.

``protocol`` (the five steps, :func:`write_data_files`), ``local`` (this rank's
pieces, each fingerprinted at hand-over), ``global_plan`` (global key order,
pieces, dedup candidates, the ``.ptd`` plans from sizes and fingerprints),
``temp_files`` (rank 0's temp files at full size, each rank's pieces written with
``pwrite`` and digested as written), ``collective`` (the one helper every step
runs through, after torch DCP's ``_DistWrapper``), ``composable_fingerprint`` (a
fingerprint that composes across pieces) and ``errors``.
"""

from .protocol import DistributedIntegrityError, DistributedReport, DistributedWriteError, write_data_files

__all__ = ["DistributedIntegrityError", "DistributedReport", "DistributedWriteError", "write_data_files"]
