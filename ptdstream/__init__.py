"""ptdstream: write ExecuTorch .pte/.ptd artifacts as a stream, byte-identical to
ExecuTorch's own serializer, in bounded host memory.

Three ways in:

* ``ptdstream.save(manager, "model.pte")``: drop-in for ``write_to_file`` +
  ``write_tensor_data_to_file``;
* the ``ptdstream`` command (``verify``, ``inspect``, ``demo``);
* the embedding API: :class:`StreamingNamedDataStore`, :func:`plan_pte`,
  :func:`plan_ptd`, :class:`ChunkedFileSink` and :func:`write_plan`.
"""

from . import patch
from .errors import FormatError, IntegrityError, LayoutError, PtdstreamError, StateError
from .fingerprint import Fingerprint
from .plan import FilePlan
from .ptd import plan_ptd
from .pte import PteOptions, plan_pte
from .save import SavePlan, SaveReport, plan_manager, save
from .sink import ChunkedFileSink
from .sources import BufferRing, FileRangeSource, MemorySource, Source, TensorSource, as_source
from .store import StreamingNamedDataStore
from .writer import write_plan

__version__ = "0.1.0"

__all__ = [
    "BufferRing",
    "ChunkedFileSink",
    "FilePlan",
    "FileRangeSource",
    "Fingerprint",
    "FormatError",
    "IntegrityError",
    "LayoutError",
    "MemorySource",
    "PtdstreamError",
    "PteOptions",
    "SavePlan",
    "SaveReport",
    "Source",
    "StateError",
    "StreamingNamedDataStore",
    "TensorSource",
    "as_source",
    "constants_by_reference",
    "install",
    "plan_manager",
    "plan_pte",
    "plan_ptd",
    "save",
    "write_plan",
]


def install() -> None:
    """Route executorch's save paths through ptdstream and record configs.

    See :func:`ptdstream.patch.install`.
    """
    from .patch import install as _install

    _install()


def constants_by_reference():
    """Context manager: executorch's emitter keeps constants as references to their
    tensors, not ``bytes`` copies (wrap ``to_executorch()``).

    See :func:`ptdstream.constants.constants_by_reference`.
    """
    from .constants import constants_by_reference as _constants_by_reference

    return _constants_by_reference()
