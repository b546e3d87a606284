"""A checkpoint folder's file that is no regular file (a FIFO, a symlink to one, a
socket, a character device) is refused by name, never waited on or read forever:
through ``ptdstream weights`` and ``open_checkpoint`` of an index or a DCP folder
(child processes, their timeout only a safety net far above any honest run) and
through ``weights_from`` (in this process: the test holds the FIFO's writer end
open with a short header in it, so code that opened it blocking would read that
and answer, not hang)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from conftest import Mlp, export
from executorch.exir import ExecutorchBackendConfig

import ptdstream

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIFO = "a FIFO (named pipe): reading it could wait forever, not a regular file"
CHAR = "a character device: it may never end, not a regular file"


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """model.pte (external constants) and a safetensors checkpoint of its weights."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("program")
    torch.manual_seed(0)
    model = Mlp()
    ptdstream.save(export(model, config=ExecutorchBackendConfig(external_constants=True)), str(folder / "model.pte"))
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, str(folder / "ck.safetensors"))
    return folder


def _special(kind: str, path) -> str:
    """Make ``path`` a file of ``kind``; return what the refusal says it is."""
    if kind == "fifo":
        os.mkfifo(path)
        return FIFO
    if kind == "symlink to a fifo":
        os.mkfifo(str(path) + ".pipe")
        os.symlink(os.path.basename(str(path)) + ".pipe", path)
        return FIFO
    if kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
        return "a socket, not a regular file"
    os.symlink(kind, path)  # a device
    return CHAR


KINDS = ["fifo", "symlink to a fifo", "socket", "/dev/zero", "/dev/null"]


def weights_cli(*argv):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "ptdstream", "weights", *map(str, argv)], env=env,
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    return p.returncode, p.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_ptdstream_weights_refuses_a_folders_special_safetensors_file_by_name(program, tmp_path, kind):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    what = _special(kind, folder / "model.safetensors")
    rc, err = weights_cli(program / "model.pte", "--from", folder, "-o", tmp_path / "out")
    assert (rc, err) == (2, f"ptdstream: cannot read {folder / 'model.safetensors'}: {what}\n")
    assert not (tmp_path / "out").exists()


def test_ptdstream_weights_refuses_a_shard_its_index_names_that_links_to_a_fifo(program, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(program / "ck.safetensors", folder / "model-00001-of-00002.safetensors")
    _special("symlink to a fifo", folder / "model-00002-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        '{"weight_map": {"l1.weight": "model-00001-of-00002.safetensors", '
        '"l1.bias": "model-00002-of-00002.safetensors"}}')
    rc, err = weights_cli(program / "model.pte", "--from", folder, "-o", tmp_path / "out")
    assert (rc, err) == (1, f"ptdstream: invalid file: {folder / 'model.safetensors.index.json'}: shard "
                            f"'model-00002-of-00002.safetensors' (for 1 key(s): 'l1.bias') cannot be read: {FIFO}\n")


class _WriterHeld:
    """The FIFO's writer end held open with ``data`` in it: a blocking open of the
    reader end returns at once (no hang on code that does not refuse FIFOs)."""

    def __init__(self, path, data: bytes = (24).to_bytes(8, "little") + b'{"a":{"dtype":"F32",') -> None:
        fifo = os.path.realpath(path)
        self.fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK) if os.path.exists(fifo) else None
        if self.fd is not None:
            os.write(self.fd, data)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["model.safetensors", "ckpt.pt"])
def test_weights_from_refuses_a_special_checkpoint_file_by_name(tmp_path, kind, name):
    from ptdstream.weightless import weights_from

    folder = tmp_path / "ckpt"
    folder.mkdir()
    path = folder / name
    what = _special(kind, path)
    given = folder if name.endswith(".safetensors") else path  # a .pt is named itself
    held = _WriterHeld(path) if "fifo" in kind else None
    try:
        with pytest.raises(OSError) as raised:
            with weights_from(str(given)):
                pass
    finally:
        if held is not None:
            held.close()
    assert str(raised.value) == f"[Errno 22] {what}: '{path}'"
    assert sorted(os.listdir(folder)) == sorted([name] + ([name + ".pipe"] if kind == "symlink to a fifo" else []))


_OPEN_IN_A_CHILD = r"""
import sys
from ptdstream.sources.checkpoint import open_checkpoint
try:
    open_checkpoint(sys.argv[1], sys.argv[2]).close()
    print("opened")
except OSError as e:
    print(type(e).__name__, e)
"""


def open_in_a_child(path, format="auto") -> str:
    """What ``open_checkpoint(path, format)`` says, in a child (the timeout only a
    safety net: a reader that opened the FIFO blocking waits there for ever)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _OPEN_IN_A_CHILD, str(path), format], env=env, capture_output=True,
                       text=True, stdin=subprocess.DEVNULL, timeout=600)
    return p.stdout.strip() or p.stderr[-2000:]


def test_an_index_that_is_a_fifo_is_refused_by_name(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    os.mkfifo(index)
    assert open_in_a_child(index) == f"OSError [Errno 22] {FIFO}: '{index}'"


def test_a_dcp_folder_holding_a_fifo_is_refused_before_dcp_opens_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(folder), no_dist=True)
    data = next(n for n in os.listdir(folder) if n.endswith(".distcp"))
    os.unlink(folder / data)
    os.mkfifo(folder / data)
    assert open_in_a_child(folder, "dcp") == f"OSError [Errno 22] {FIFO}: '{folder / data}'"
