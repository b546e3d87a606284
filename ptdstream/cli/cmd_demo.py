"""``ptdstream demo``: the main job on the built-in example."""

from __future__ import annotations

from .common import EPILOG, add_command


def register(subparsers) -> None:
    """Add ``demo`` to ``subparsers``."""
    d = add_command(
        subparsers, "demo", help="export a small model and save it with ptdstream",
        description="Export a small transformer LM (tied embeddings, two methods, XNNPACK, weights in a "
                    ".ptd), stream-save it with ptdstream, verify byte identity against ExecuTorch's "
                    "serializer (streamed, not written), run it with the ExecuTorch runtime and compare "
                    "with eager PyTorch.",
        epilog=EPILOG, run=run, imports_torch=True)
    from ..demo import add_arguments

    add_arguments(d)


def run(args) -> int:
    from ..demo.run import main

    return int(main(args) or 0)
