"""``ptdstream inspect``: sections, keys, sizes, alignments and duplicated content."""

from __future__ import annotations

from .common import EXIT_OK, add_command, print_report

__all__ = ["register", "run"]


def register(subparsers) -> None:
    """Add ``inspect`` to ``subparsers``."""
    i = add_command(
        subparsers, "inspect", help="sections, keys, sizes, alignments and duplicated content",
        description="Show each file's section map, segments with their alignment, keys, a size breakdown "
                    "(metadata + padding + payload = file size) and content stored more than once.",
        examples=[("ptdstream inspect model.pte model.ptd", "sections, segments, keys, sizes, duplicates"),
                  ("ptdstream inspect out/*.ptd --json", "the same, as JSON"),
                  ("ptdstream unpack model.ptd.zst - | ptdstream inspect -", "a file from stdin")],
        run=run, inputs=lambda a: a.files, stdin=("files",))
    i.add_argument("files", nargs="+", metavar="FILE")


def run(args) -> int:
    """``ptdstream inspect``: print each file's sections, keys and duplicate content."""
    from ..check.inspection import inspect_files

    print_report(args, inspect_files(args.files))
    return EXIT_OK
