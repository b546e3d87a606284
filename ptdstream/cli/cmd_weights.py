"""``ptdstream weights``: the .ptd files of an exported program, from a checkpoint."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

from ..errors import PtdstreamError
from ..sources.checkpoint import FORMATS
from ..system.files import files_of, open_input
from .common import EXIT_OK, STDIN_NAME, add_command, print_report, progress_wanted
from .errors import UsageError

__all__ = ["check", "outputs", "register", "run"]


def _mapping(text: str):
    old, sep, new = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not PROGRAM_PREFIX=CHECKPOINT_PREFIX")
    return old, new


def register(subparsers) -> None:
    """Add ``weights`` to ``subparsers``."""
    p = add_command(
        subparsers, "weights", help="write a program's .ptd files from a checkpoint (no re-export)",
        description="Write every .ptd that PROGRAM (a .pte exported with external constants) loads, from the "
                    "tensors of CHECKPOINT: byte-identical to the .ptd files a re-export with those weights "
                    "writes. Every key is checked (dtype, shape, dim order) first; missing, extra and mismatched "
                    "keys are all reported and nothing is written. Programs with delegates are refused (their "
                    "weights are inside the .pte), except XNNPACK with tagged external weights given --like and "
                    "--old, where its weights are stored untransformed: then a new .pte is written too.",
        examples=[("ptdstream weights model.pte --from finetuned.safetensors -o out/", "safetensors file"),
                  ("ptdstream weights model.pte --from hf_folder/ --map lm_head.=model.lm_head. -o out/",
                   "Hugging Face folder, other key names"),
                  ("ptdstream weights model.pte --from dcp_ckpt/ --format dcp --like old/weights.ptd -o out/",
                   "a trusted torch.distributed.checkpoint folder, tags and key order of an old .ptd"),
                  ("ptdstream weights model.pte --from new.safetensors --old old.safetensors "
                   "--like old/model.ptd -o out/", "XNNPACK with tagged external weights")],
        exit_codes="checkpoints: a .safetensors file, a Hugging Face folder or model.safetensors.index.json, a "
                   "torch.save state dict (read with weights_only=True), a torch.distributed.checkpoint folder "
                   "only with --format dcp (its metadata is a pickle that runs code: trusted checkpoints only)\n"
                   "exit codes: 0 written, 1 the checkpoint does not fit the program, or a shard its index "
                   "names is missing, unreadable or outside its folder (nothing written), "
                   "2 usage error, unreadable input or an -o folder that cannot be created or written",
        progress=True,
        run=run, inputs=lambda a: [a.program, *a.like, *files_of(a.checkpoint), *files_of(a.old_checkpoint)],
        outputs=outputs,
        output_folders=lambda a: [a.out],
        stdin=("program",), imports_torch=True, check=check)
    p.add_argument("program", help="the .pte (only its metadata is read; - for stdin)")
    p.add_argument("--from", dest="checkpoint", required=True, help="the checkpoint (file or folder)")
    p.add_argument("-o", "--out", "--output", dest="out", required=True,
                   help="folder for the .ptd files (created with its parents if missing)")
    p.add_argument("--like", action="append", default=[], metavar="PTD",
                   help="a .ptd of the original export: gives each key's tag (file) and the key order; repeat")
    p.add_argument("--tag", help="tag of every key without --like (default _default_external_constant)")
    p.add_argument("--map", action="append", default=[], type=_mapping, metavar="PROGRAM_PREFIX=CKPT_PREFIX",
                   help="look a program key starting with PROGRAM_PREFIX up with CKPT_PREFIX instead; repeat")
    p.add_argument("--old", dest="old_checkpoint", metavar="CHECKPOINT",
                   help="XNNPACK with tagged external weights (with --like): the weights the program was exported "
                        "with; untransformed XNNPACK weights are rewritten and a new .pte is written to OUT")
    p.add_argument("--format", default="auto", choices=FORMATS,
                   help="how to read CHECKPOINT (default auto: safetensors or a weights-only torch.save; dcp, "
                        "whose metadata is a pickle that runs code, only for a checkpoint you trust)")
    p.add_argument("--old-format", default="auto", choices=FORMATS, help="how to read --old (as --format)")
    p.add_argument("--allow-extra", action="store_true", help="ignore checkpoint keys the program does not use")
    p.add_argument("--keep", action="append", default=[], metavar="KEY",
                   help="copy KEY's exported bytes unchanged from the --like file holding it (a buffer no "
                        "checkpoint saves, such as a non-persistent causal mask); repeat")
    p.add_argument("--segment-alignment", type=int, default=128, help="bytes (default %(default)s)")


def outputs(args) -> list[str]:
    """The files ``weights`` writes into ``-o``: ``<tag>.ptd`` for each tag (the ``--like``
    files' names, else ``--tag`` or ``_default_external_constant``) and, with ``--old``,
    the new ``.pte`` named after PROGRAM: refused before torch is imported where one
    exists (without ``-f``) or is an input. A tag that names no file is the check's
    to report (nothing listed for it)."""
    from ..format.ptd import ptd_file_name
    from ..weights.check import like_tag
    from ..weights.write import DEFAULT_TAG

    if not args.out or args.out == "-":  # check() refuses them
        return []
    names = []
    tags = [like_tag(p) for p in args.like] if args.like else [DEFAULT_TAG if args.tag is None else args.tag]
    for tag in dict.fromkeys(tags):
        try:
            names.append(ptd_file_name(tag))
        except PtdstreamError:  # a separator in the tag: write_ptd names it
            continue
    if args.old_checkpoint is not None and args.program != "-":
        names.append(os.path.basename(args.program))
    return [os.path.join(args.out, n) for n in names]


def check(args) -> None:
    """The arguments, before torch is imported.

    Raises:
        UsageError: a non-positive ``--segment-alignment``, an empty ``-o``, ``-o -``
            (a folder is needed), ``-o`` that is a file or lies under one, ``--old``
            with the program from stdin (the new .pte is named after it), a file of
            the wrong kind by its identifier (a .ptd as PROGRAM, a .pte or .ptd as a
            checkpoint, a .pte as ``--like``).
    """
    if args.segment_alignment <= 0:  # before the modulo by it
        raise UsageError(f"ptdstream weights: --segment-alignment must be a positive number of bytes, "
                         f"got {args.segment_alignment}")
    if not args.out:  # else the folder would be "" (not created, never the current one)
        raise UsageError("ptdstream weights: -o: an empty path, cannot write there; give a folder (. for this one)")
    if args.out == "-":  # elsewhere - is stdout: never a folder named "-" by surprise
        raise UsageError("ptdstream weights: -o -: the .ptd files need a folder, not standard output; "
                         "give a folder (./- if a folder named - is meant)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):  # as an -o a file on the path of: one form
        raise UsageError(f"ptdstream: cannot write {args.out}: Not a directory (a file: give a folder)")
    above = _existing_parent(args.out)
    if not os.path.isdir(above):
        raise UsageError(f"ptdstream: cannot write {args.out}: Not a directory")  # as mkdir under the file says
    if args.old_checkpoint is not None and args.program == getattr(args, "stdin_spool", None):
        raise UsageError("ptdstream weights: --old writes a new .pte named after PROGRAM, which is - (stdin); "
                         "give the program as a file")
    _refuse_wrong_kinds(args)


_WANTED = "the new weights (a .safetensors file, a Hugging Face folder or a torch.save state dict)"


def _refuse_wrong_kinds(args) -> None:
    """A .pte or .ptd where another kind of file is wanted, told by its identifier."""
    spool = getattr(args, "stdin_spool", None)
    program = STDIN_NAME if args.program == spool else args.program
    if _kind(args.program) == "ptd":
        raise UsageError(f"ptdstream weights: {program} is a .ptd (FlatTensor data), not a program: PROGRAM is "
                         "the .pte exported with it; a .ptd of that export goes to --like (its tags and key order)")
    for option, path in (("--from", args.checkpoint), ("--old", args.old_checkpoint)):
        kind = _kind(path) if path is not None else None
        if kind == "pte":
            raise UsageError(f"ptdstream weights: {option} {path} is a .pte (an ExecuTorch program), not a "
                             f"checkpoint: give {_WANTED}; the program goes first, as PROGRAM")
        if kind == "ptd":
            raise UsageError(f"ptdstream weights: {option} {path} is a .ptd (FlatTensor data), not a "
                             f"checkpoint: give {_WANTED}; a .ptd of the original export goes to --like")
    for path in args.like:
        if _kind(path) == "pte":
            raise UsageError(f"ptdstream weights: --like {path} is a .pte (an ExecuTorch program), not a .ptd: "
                             "--like takes the .ptd files of the original export; the program goes first, as PROGRAM")


def _kind(path: str) -> str | None:
    """``"pte"`` or ``"ptd"`` from a regular file's identifier (bytes 4..8), else None
    (a folder, a missing or unreadable file, or another kind: the command reports it)."""
    from ..format.identity import kind_of

    if not os.path.isfile(path):
        return None
    try:
        with open_input(path) as f:
            return kind_of(f.read(8)[4:])
    except OSError:
        return None


def _existing_parent(path: str) -> str:
    """``path`` or the nearest of its parents that exists (a link that does not resolve: itself)."""
    folder = os.path.abspath(path)
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    return folder if os.path.exists(folder) else os.path.dirname(folder)


def run(args) -> int:
    """``ptdstream weights``: write the ``.ptd`` files of a program from a checkpoint
    (:func:`~ptdstream.weights.write_ptd`)."""
    from ..weights import write_ptd

    with _folder(args.out):
        report = write_ptd(args.program, args.checkpoint, args.out, like=args.like, tag=args.tag,
                           key_map=dict(args.map) or None, allow_extra=args.allow_extra,
                           segment_alignment=args.segment_alignment, progress=progress_wanted(args),
                           old_checkpoint=args.old_checkpoint, format=args.format, old_format=args.old_format,
                           keep=args.keep, force=args.force)
    print_report(args, report)
    return EXIT_OK


@contextlib.contextmanager
def _folder(path: str) -> Iterator[None]:
    """Create ``path`` and its missing parents (as ``optimum-cli --output_dir``); if the
    body raises, remove the folders created here again when they are still empty.

    Raises:
        OSError: a folder cannot be created; a symbolic link on the path that
            leads nowhere gives its own reason (ELOOP for a loop, ENOENT for a
            dangling link), not the ``EEXIST`` of ``mkdir`` on the link.
    """
    created = []
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        if os.path.lexists(folder):  # a link that does not resolve
            os.stat(folder)  # raises ELOOP or ENOENT naming it
        created.append(folder)
        folder = os.path.dirname(folder)
    for f in reversed(created):
        os.mkdir(f)
    try:
        yield
    except BaseException:
        for f in created:
            with contextlib.suppress(OSError):  # not empty: something else wrote there meanwhile
                os.rmdir(f)
        raise
