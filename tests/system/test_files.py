"""system.files: exact positional reads; one file by device and inode; the overwrite rule of the CLI."""

from __future__ import annotations

import os

import pytest

from ptdstream.errors import OverwriteError
from ptdstream.system import files
from ptdstream.system.files import pread_bytes, refuse_overwrite, same_file


def test_pread_bytes_reads_exactly_across_short_reads_and_stops_at_the_end(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(200)))
    real = os.pread
    calls = []

    def short(fd, n, offset):  # a read that returns at most 7 bytes, as a slow file system may
        calls.append((n, offset))
        return real(fd, min(n, 7), offset)

    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_bytes(fd, 50, 100) == bytes(range(100, 150))  # read whole
        monkeypatch.setattr(files.os, "pread", short)
        assert pread_bytes(fd, 50, 10) == bytes(range(10, 60))
        assert calls[:2] == [(50, 10), (43, 17)]
        assert pread_bytes(fd, 50, 180) == bytes(range(180, 200))  # the file ends first: fewer bytes
        assert pread_bytes(fd, 5, 300) == b""
    finally:
        os.close(fd)


def test_same_file_by_device_and_inode(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x")
    b.write_bytes(b"x")
    os.link(a, tmp_path / "hard")
    (tmp_path / "soft").symlink_to(a)
    assert same_file(str(a), str(tmp_path / "hard"))
    assert same_file(str(a), str(tmp_path / "soft"))
    assert same_file(str(a), str(tmp_path / "." / "a"))
    assert not same_file(str(a), str(b))  # equal bytes, another file
    assert not same_file(str(a), str(tmp_path / "missing"))


def test_refuse_overwrite(tmp_path):
    a, out = tmp_path / "a", tmp_path / "out"
    a.write_bytes(b"x")
    refuse_overwrite([str(a)], [str(out), None])  # new output: fine
    out.write_bytes(b"y")
    with pytest.raises(OverwriteError, match=r"output .*out exists; use -f/--force to replace it"):
        refuse_overwrite([str(a)], [str(out)])
    refuse_overwrite([str(a)], [str(out)], force=True)
    with pytest.raises(OverwriteError, match=r"output .*/a is also an input: "):
        refuse_overwrite([str(a)], [str(a)], force=True)


def test_open_input_fd_refuses_what_is_no_regular_file_by_name_and_kind_without_waiting(tmp_path):
    """A FIFO with no writer (a blocking open would wait forever), a link to one, a
    socket, character devices and a folder: each refused at once, naming the path."""
    import errno
    import socket

    from ptdstream.system.files import open_input, open_input_fd

    fifo, link, sock = tmp_path / "fifo", tmp_path / "link", tmp_path / "sock"
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    s.close()
    fifo_said = "a FIFO (named pipe): reading it could wait forever, not a regular file"
    for path, said in ((fifo, fifo_said), (link, fifo_said), (sock, "a socket, not a regular file"),
                       ("/dev/null", "a character device: it may never end, not a regular file"),
                       ("/dev/zero", "a character device: it may never end, not a regular file")):
        with pytest.raises(OSError) as raised:
            open_input_fd(str(path))
        assert (raised.value.errno, raised.value.strerror, raised.value.filename) == (errno.EINVAL, said, str(path))
    with pytest.raises(IsADirectoryError) as raised:
        open_input(str(tmp_path))
    assert raised.value.filename == str(tmp_path)
    regular = tmp_path / "f"
    regular.write_bytes(b"abc")
    with open_input(str(regular)) as f:
        assert f.read() == b"abc" and os.get_blocking(f.fileno())
