"""The known, harmless noise of the pinned stack, silenced by ``python -m ptdstream.hf`` only.

Each entry below is printed by every export on this stack and asks nothing of the
user; the command line's process entry point (``ptdstream/hf/__main__.py``, what
``python -m ptdstream.hf`` runs) drops exactly these, by logger and message,
before anything is imported. The library (``ptdstream.hf.export``, and
``ptdstream.hf.main()`` called from a user's code) leaves the user's logging and
warning filters as they are. Everything else still prints: docs/troubleshooting.md lists what remains
(the emitter's ``Mutation on a buffer`` warning names the user's own buffers),
and ``PTDSTREAM_DEBUG=1`` keeps even these.

* torchao 0.18: ``Failed to load .../torchao/_C_mxfp8...so`` and
  ``_C_cutlass_90a.abi3.so`` (logger ``torchao``): CUDA kernels on a CPU machine;
* torch 2.13: ``<enum 'KernelPreference'> is an Enum subclass and is now natively
  supported by torch.compile ...`` (logger ``torch.utils._pytree``), raised while
  torchao registers its enums;
* torch 2.13: ``FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated``
  (``torch/utils/_pytree.py``), from torch's own pytree code;
* transformers 5.0.0rc1: ``` `torch_dtype` is deprecated! Use `dtype` instead! ```
  (logger ``transformers.configuration_utils``): optimum-executorch 1.1.0 passes
  ``torch_dtype``;
* transformers' ``Loading weights`` bar, when stderr is no terminal (a log file
  gets every update of it on one line, 6 KB for a tiny model): off unless
  ``HF_HUB_DISABLE_PROGRESS_BARS`` is set; the command prints its own stages.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

__all__ = ["KNOWN_RECORDS", "KNOWN_WARNINGS", "silence_known_noise"]

#: ``(logger name, message pattern)`` of the log records dropped.
KNOWN_RECORDS = (
    ("torchao", r"Failed to load .*/torchao/_C_[\w.-]+\.so"),
    ("torch.utils._pytree", r"<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile"),
    ("transformers.configuration_utils", r"`torch_dtype` is deprecated! Use `dtype` instead!"),
)

#: ``(category, message pattern)`` of the warnings ignored.
KNOWN_WARNINGS = (
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
)


class _Drop(logging.Filter):
    """Drops the records whose message matches ``pattern``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not self.pattern.search(record.getMessage())
        except Exception:  # noqa: BLE001 - a record that cannot format is not ours to drop
            return True


def silence_known_noise() -> None:
    """Drop the noise listed in the module docstring for the rest of the process
    (the command line's entry point only); nothing with ``PTDSTREAM_DEBUG=1``."""
    if os.environ.get("PTDSTREAM_DEBUG"):
        return
    for name, pattern in KNOWN_RECORDS:
        logging.getLogger(name).addFilter(_Drop(pattern))
    for category, pattern in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
