"""Many ranks, one artifact: :func:`write_data_files` called on every rank of a
``torch.distributed`` group writes one set of ``.ptd`` files, each rank writing
only the bytes it holds (see :mod:`ptdstream.distributed.writer`)."""

from .writer import DistributedIntegrityError, DistributedReport, DistributedWriteError, write_data_files

__all__ = ["DistributedIntegrityError", "DistributedReport", "DistributedWriteError", "write_data_files"]
