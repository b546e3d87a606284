"""Hugging Face models through optimum-executorch, saved by ptdstream.

Needs ``pip install "ptdstream[hf]"`` (optimum-executorch 1.1.0, transformers
5.0.0rc1). Two entry points, both optimum-executorch's own, with every
``.pte``/``.ptd`` written by ptdstream's streaming writer (byte for byte what
executorch 1.5.1's writer gives on the same manager) and constants kept by
reference in the emitter and in XNNPACK's lowering:

* :func:`export`: ``optimum.exporters.executorch.main_export``
  (``export("my-llama/", "out/", task="text-generation", recipe="xnnpack")``);
* :func:`main`: the ``optimum-cli`` command, as
  ``python -m ptdstream.hf export executorch -m DIR --task text-generation --recipe xnnpack -o OUT``.

Both print the files they wrote on stderr at the end (:class:`ExportReport`;
``export(..., quiet=True)`` does not) and silence the FutureWarnings and
coremltools' import warnings of the export.

Both take one more option, ``weightless=True`` / ``--weightless``: the model is
built from the folder's ``config.json`` with storage-less parameters (no weight
is read while optimum traces and lowers it) and each exported program is bound
to the folder's safetensors shards, which the save streams
(:func:`ptdstream.weightless.hf.pretrained_without_weights`; the same bytes as
the export on loaded weights).

:func:`saving_with_ptdstream` is the context both run in. Nothing here
downloads: pass a local folder, and set ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cli import main
    from .routes import export
    from .saving import ExportReport, saving_with_ptdstream

__all__ = ["ExportReport", "export", "main", "saving_with_ptdstream"]

#: Public names, each loaded from its module on first use (``python -m ptdstream.hf --help``
#: and the argument checks import neither optimum nor torch).
_LAZY = {"export": "routes", "main": "cli", "ExportReport": "saving", "saving_with_ptdstream": "saving"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
