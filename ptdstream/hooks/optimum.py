"""Hugging Face models through optimum-executorch, saved by ptdstream.

optimum-executorch 1.1.0 saves in one place,
``optimum/exporters/executorch/convert.py::export_to_executorch``: for each
``ExecutorchProgramManager`` its recipe returns, ``manager.write_to_file(f)``
into ``<output_dir>/<name>.pte`` (a file it opened with ``"wb"``), then
``manager.write_tensor_data_to_file(output_dir)``. :func:`ptdstream.install`
(:mod:`ptdstream.hooks.install`) takes over both, so every ``.pte``/``.ptd`` it writes comes from ptdstream's
streaming writer, byte for byte what executorch 1.5.1's writer gives on the
same manager. :func:`export` and :func:`main` add
:func:`ptdstream.constants_by_reference` and
:func:`~ptdstream.hooks.xnnpack.xnnpack_constants_by_reference` around the
whole export, so the emitter (the embedding table, constants XNNPACK does not
take) and XNNPACK's lowering (the weights it takes unchanged) keep references to
tensors instead of ``bytes`` copies.

Two entry points, both optimum-executorch's own, with ptdstream saving:

* :func:`export`: ``optimum.exporters.executorch.main_export``;
* :func:`main`: the ``optimum-cli`` command, as ``python -m ptdstream.hooks.optimum``
  followed by optimum-cli's arguments, e.g.
  ``export executorch --model DIR --task text-generation --recipe xnnpack --output_dir OUT``.

Needs ``pip install "ptdstream[hf]"`` (optimum-executorch 1.1.0, transformers
5.0.0rc1). Nothing here downloads: pass a local folder, and set
``HF_HUB_OFFLINE=1`` to make huggingface_hub refuse any network access.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence

from .emitter import constants_by_reference
from .install import installed
from .xnnpack import xnnpack_constants_by_reference

__all__ = ["export", "main", "saving_with_ptdstream"]


@contextlib.contextmanager
def saving_with_ptdstream(by_reference: bool = True) -> Iterator[None]:
    """Inside: executorch's save methods are ptdstream's
    (:func:`ptdstream.hooks.install.installed`) and, with ``by_reference``,
    the emitter and XNNPACK's lowering keep constants by reference
    (:func:`ptdstream.constants_by_reference`,
    :func:`ptdstream.hooks.xnnpack.xnnpack_constants_by_reference`).

    Nests with :func:`ptdstream.install`: an install made before entering stays
    after leaving (the patches are restored by the last exit).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(installed())
        if by_reference:
            stack.enter_context(constants_by_reference())
            stack.enter_context(xnnpack_constants_by_reference())
        yield


def export(model_dir: str, output_dir: str, task: str, recipe: str = "xnnpack", *,
           by_reference: bool = True, **options) -> dict[str, object]:
    """``optimum.exporters.executorch.main_export`` with ptdstream saving.

    Args:
        model_dir: a local Hugging Face model folder (``config.json`` and
            safetensors weights, as ``save_pretrained`` writes them).
        output_dir: where ``<name>.pte`` (``model.pte`` for every recipe of
            1.1.0) and any ``<tag>.ptd`` go; created if missing (by optimum).
        task: optimum-executorch's task name (``"text-generation"``,
            ``"fill-mask"``, ``"image-classification"``,
            ``"automatic-speech-recognition"``, ...). Required: without it
            optimum asks the Hub which task the folder is.
        recipe: ``"xnnpack"`` or ``"portable"`` on a CPU machine.
        by_reference: also keep constants by reference in the emitter and in
            XNNPACK's lowering (saves one host copy of every constant they take
            unchanged; the files are the same bytes).
        **options: optimum's own task options, passed on unchanged:
            ``qlinear="8da4w"``, ``qembedding="8w"``, ``use_custom_sdpa=True``,
            ``use_custom_kv_cache=True``, ``max_seq_len=...``, ``dtype=...``.

    Returns:
        ``{name: ExecutorchProgramManager}`` as ``main_export`` returns it.

    Raises:
        ImportError: optimum-executorch is not installed (``ptdstream[hf]``).
        PtdstreamError: a save failed (upstream's writer would have logged).
    """
    from optimum.exporters.executorch import main_export

    with saving_with_ptdstream(by_reference):
        return main_export(model_dir, task=task, recipe=recipe, output_dir=output_dir, **options)


def main(argv: Sequence[str] | None = None) -> int:
    """``optimum-cli`` with ptdstream saving; arguments as ``optimum-cli`` takes them.

    ``python -m ptdstream.hooks.optimum export executorch -m DIR --task
    fill-mask --recipe xnnpack -o OUT [--qlinear 8da4w] [--use_custom_sdpa]``.
    Constants are kept by reference during the export. Returns 0; optimum's
    own errors propagate (its parser exits 2 on bad arguments).
    """
    from optimum.commands.optimum_cli import main as optimum_cli_main

    args = list(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    sys.argv = ["optimum-cli", *args]
    try:
        with saving_with_ptdstream(by_reference=True):
            optimum_cli_main()
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
