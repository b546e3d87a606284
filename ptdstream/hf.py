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
coremltools' import warnings of the export. :func:`saving_with_ptdstream` is
the context both run in. Nothing here
downloads: pass a local folder, and set ``HF_HUB_OFFLINE=1``.
"""

import sys

from .hooks.optimum import ExportReport, export, main, saving_with_ptdstream

__all__ = ["ExportReport", "export", "main", "saving_with_ptdstream"]

if __name__ == "__main__":
    sys.exit(main())
