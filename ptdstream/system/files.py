"""File primitives every stage uses: exact positional reads and input checks."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from typing import BinaryIO

__all__ = ["case_insensitive", "check_regular_inputs", "files_of", "not_regular", "open_input", "open_input_fd",
           "pread_bytes", "pread_exact", "pwrite_all", "refuse_overwrite", "refuse_stdin_output", "same_file"]


def pread_exact(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at file ``offset`` (bytes), looping on short reads.

    Returns the bytes read: ``len(view)``, or fewer when the file ends first
    (callers turn that into their own error, naming file and offset).
    """
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def pread_bytes(fd: int, nbytes: int, offset: int) -> bytes:
    """``nbytes`` bytes of ``fd`` from file ``offset`` (bytes), looping on short
    reads; fewer only when the file ends first (callers turn that into their own
    error, naming file and offset, as for :func:`pread_exact`)."""
    data = os.pread(fd, nbytes, offset)
    if len(data) == nbytes or not data:
        return data
    parts = [data]
    done = len(data)
    while done < nbytes:
        more = os.pread(fd, nbytes - done, offset + done)
        if not more:
            break
        parts.append(more)
        done += len(more)
    return b"".join(parts)


def pwrite_all(fd: int, view: memoryview, offset: int) -> int:
    """Write all of ``view`` to ``fd`` at file ``offset``, looping on short writes;
    returns the bytes written (``view`` of any format counts in bytes).

    Raises:
        OSError: a write failed (ENOSPC, EIO, ... as ``os.pwrite`` raises
            it), or made no progress (EIO); its ``offset``
            attribute is the file offset (bytes) of the write that failed.
    """
    view = memoryview(view).cast("B")
    total = len(view)
    while len(view):
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as e:
            # Where the failed write began, for the caller's message.
            e.offset = offset  # type: ignore[attr-defined]  # an added attribute, documented above
            raise
        if n <= 0:
            err = OSError(errno.EIO, "pwrite wrote nothing")
            err.offset = offset  # type: ignore[attr-defined]  # an added attribute, documented above
            raise err
        view, offset = view[n:], offset + n
    return total


#: What each kind of file that is not a regular one is, for messages.
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe): reading it could wait forever"),
          (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device: it may never end"),
          (stat.S_ISBLK, "a block device"))


def not_regular(mode: int, path: str, block_device: bool = False) -> OSError | None:
    """The error for a file of ``mode`` (``st_mode``) at ``path`` that is no regular
    file (nor, with ``block_device``, a block device), or None when it is one.

    Returns:
        ``IsADirectoryError`` for a folder; an ``OSError`` (``EINVAL``) naming
        ``path`` and its kind ("a FIFO (named pipe) ..., not a regular file")
        for a FIFO, socket or device.
    """
    if stat.S_ISREG(mode) or (block_device and stat.S_ISBLK(mode)):
        return None
    if stat.S_ISDIR(mode):
        return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    kind = next((what for test, what in _KINDS if test(mode)), "of an unknown kind")
    return OSError(errno.EINVAL, f"{kind}, not a regular file", path)


def open_input_fd(path: str, block_device: bool = False) -> int:
    """Open ``path`` for reading without blocking and return its descriptor, only
    if it is a regular file (or, with ``block_device``, a block device): opened
    ``O_RDONLY | O_NONBLOCK`` (a FIFO's open does not wait for a writer), then
    ``fstat`` on the descriptor (the file opened, not whatever the name points at
    by then), then set blocking again. Symlinks are followed; the file's kind is
    the target's. Every file ptdstream reads and did not just write is opened
    here (or through :func:`open_input`); the caller closes the descriptor.

    Raises:
        IsADirectoryError: a folder, naming it.
        OSError: (``EINVAL``) a FIFO, socket or device, naming the path and its
            kind; or the system's error (missing, permission), naming the path.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:  # a socket cannot be opened at all (ENXIO): say what it is
        if e.errno == errno.ENXIO:
            refused = not_regular(os.stat(path).st_mode, os.fspath(path), block_device)
            if refused is not None:
                raise refused from None
        raise
    try:
        refused = not_regular(os.fstat(fd).st_mode, os.fspath(path), block_device)
        if refused is not None:
            raise refused
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_input(path: str, block_device: bool = False) -> BinaryIO:
    """:func:`open_input_fd` as a buffered binary file (as ``open(path, "rb")``
    gives); the same checks and errors."""
    return os.fdopen(open_input_fd(path, block_device), "rb")


def check_regular_inputs(paths: Iterable[str]) -> None:
    """Refuse, before opening anything, inputs that are not regular files: a
    folder, a FIFO (opening it would block) or a device (it may never end).
    Missing files pass: the command reports them after its own checks. (What
    then opens them, :func:`open_input_fd`, checks the opened file again.)

    Raises:
        IsADirectoryError: a folder.
        OSError: (EINVAL) a FIFO, socket or device, naming the path.
    """
    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        refused = not_regular(mode, path)
        if refused is not None:
            raise refused


def files_of(path: str | None) -> list[str]:
    """The files a command may read through ``path``: ``[path]`` for a file (or a
    missing path: the command reports it), every regular file directly in it
    (symlinks followed, sorted) for a folder, ``[]`` for None. A checkpoint
    folder's shards and index, a saved set's files: inputs like any other."""
    if path is None:
        return []
    if not os.path.isdir(path):
        return [path]
    with os.scandir(path) as entries:
        return sorted(e.path for e in entries if e.is_file())


def case_insensitive(folder: str) -> bool:
    """Whether ``folder``'s file system ignores case in names (vfat, exFAT,
    macOS defaults, casefolded ext4): a probe file
    ``.case-probe.ptdstream-<pid>-<hex>.tmp`` is created, looked up upper-cased,
    and removed (a killed probe's file is an ordinary stale temp file). A folder
    that is missing or not writable counts as case-sensitive."""
    import secrets

    name = f".case-probe.ptdstream-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    path = os.path.join(folder, name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    os.close(fd)
    try:
        return os.path.exists(os.path.join(folder, name.upper()))
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def same_file(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name one file: same device and inode, after
    following symlinks (a hard link, a symlink or a different spelling of the
    path all count). A path that does not exist is nobody's file."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def refuse_overwrite(inputs: Iterable[str], outputs: Iterable[str], force: bool = False) -> None:
    """Refuse, before anything is written, an output that is one of the inputs
    (always) or that already exists (unless ``force``): zstd's convention for a
    command line. The Python API replaces an existing output, like upstream's; only
    ``write_ptd`` calls this (with its ``force``: True in the API, the CLI's ``-f``).

    Raises:
        OverwriteError: naming the output and the input (or the existing file).
    """
    from ..errors import OverwriteError

    inputs = [i for i in inputs if i is not None]
    for output in outputs:
        if output is None:
            continue
        for source in inputs:
            if same_file(source, output):
                spelled = "" if os.path.abspath(source) == os.path.abspath(output) else f" (as {source})"
                raise OverwriteError(
                    f"output {output} is also an input{spelled}: writing it would destroy "
                    "the input; choose another output path"
                )
        if not force and os.path.lexists(output):
            raise OverwriteError(f"output {output} exists; use -f/--force to replace it")


def _file_of_fd(fd: int) -> os.stat_result | None:
    """``fstat(fd)`` when ``fd`` is open on a regular file, else None (closed, a
    pipe, a terminal, ``/dev/null``: no file a command could destroy)."""
    try:
        st = os.fstat(fd)
    except OSError:  # closed
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def refuse_stdin_output(outputs: Iterable[str | None], fd: int = 0) -> None:
    """Refuse, before standard input is read and anything is written, an output
    that is the file ``fd`` (standard input) is open on, by device and inode
    (``ptdstream pack - -o F -f < F``): replacing it would destroy the input.
    A pipe or terminal is no file and passes; an output that does not exist yet
    cannot be it. (:func:`refuse_stdout_input` is the same rule for standard
    output and the inputs.)

    Raises:
        OverwriteError: naming the output.
    """
    from ..errors import OverwriteError

    st = _file_of_fd(fd)
    if st is None:
        return
    for output in outputs:
        if output is None:
            continue
        try:
            out = os.stat(output)
        except (FileNotFoundError, NotADirectoryError):
            continue
        if (out.st_dev, out.st_ino) == (st.st_dev, st.st_ino):
            raise OverwriteError(f"output {output} is the file standard input (-) reads: writing it would "
                                 "destroy the input; choose another output path")


def stdout_input(inputs: Iterable[str | None], fd: int = 1) -> str | None:
    """The input that file descriptor ``fd`` (standard output) is open on, by
    device and inode (``fstat``, as zstd compares them), or None. Only a regular
    file can be one: a pipe, terminal or ``/dev/null`` never is. Opened in any
    mode (``> F``, ``>> F``, ``1<> F``), writing to it would change the input.

    An input ``-`` is standard input: the file fd 0 is open on is compared
    (``< F`` with ``1<> F``), and so is a file named ``-``; it is returned as
    ``"- (stdin)"``.
    """
    out = _file_of_fd(fd)
    if out is None:
        return None
    for path in inputs:
        if path is None:
            continue
        if path == "-":
            st = _file_of_fd(0)
            if st is not None and (st.st_dev, st.st_ino) == (out.st_dev, out.st_ino):
                return "- (stdin)"
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        if (st.st_dev, st.st_ino) == (out.st_dev, out.st_ino):
            return path
    return None


def refuse_stdout_input(inputs: Iterable[str | None], fd: int = 1,
                        hint: str = "redirect stdout to another file or give -o OUT") -> None:
    """Refuse, before anything is written, a standard output that is one of the
    inputs (:func:`stdout_input`); ``hint`` ends the message (what to do instead).

    Raises:
        OverwriteError: naming the input.
    """
    from ..errors import OverwriteError

    inputs = list(inputs)
    path = stdout_input(inputs, fd)
    if path is not None:
        raise OverwriteError(
            f"standard output is the input {path}: writing to it would change the input; {hint}"
        )
