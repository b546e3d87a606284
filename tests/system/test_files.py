"""system.files: one file by device and inode; the overwrite rule of the CLI."""

from __future__ import annotations

import os

import pytest

from ptdstream.errors import OverwriteError
from ptdstream.system.files import refuse_overwrite, same_file


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
