"""``ptdstream demo``: the main job on the built-in example."""

from __future__ import annotations

from .common import add_command
from .errors import UsageError

__all__ = ["check", "register", "run"]


def register(subparsers) -> None:
    """Add ``demo`` to ``subparsers``."""
    d = add_command(
        subparsers, "demo", help="export a small model and save it with ptdstream",
        description="Export a small transformer LM (tied embeddings, two methods, XNNPACK, weights in a "
                    ".ptd), stream-save it with ptdstream, verify byte identity against ExecuTorch's "
                    "serializer (streamed, not written), run it with the ExecuTorch runtime and compare "
                    "with eager PyTorch.",
        examples=[("ptdstream demo", "into ./ptdstream-demo, then run it"),
                  ("ptdstream demo --out /tmp/demo --no-run", "another folder, without the runtime check"),
                  ("ptdstream demo --out out --reference ref", "also executorch's own files in ref/, for "
                   "`ptdstream verify out/model.pte --against ref/model.pte`")],
        exit_codes="exit codes: 0 identical and the runtime agrees, 1 a check failed, 2 usage error",
        run=run, reports=False, progress=True, imports_torch=True, check=check)
    from ..demo import add_arguments

    add_arguments(d)


def check(args) -> None:
    """The output folders, created before torch is imported.

    Raises:
        UsageError: ``--out`` or ``--reference`` cannot be used (:func:`ptdstream.demo.check_folders`).
    """
    from ..demo import check_folders

    refused = check_folders(args)
    if refused is not None:
        raise UsageError(refused)


def run(args) -> int:
    """``ptdstream demo``: the exit code of the built-in example."""
    from ..demo.run import main

    return int(main(args) or 0)
