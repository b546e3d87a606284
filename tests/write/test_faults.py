"""Injected failures: each gives a clear error, publishes nothing, leaves no temp file.

Every test starts from a folder holding a previous complete save (another
model's files) and checks, after the failure, that those files are byte-identical
to before and that nothing else is in the folder. Faults come from the real
kernel where that is cheap (``RLIMIT_FSIZE``, a full tmpfs, a read-only folder,
signals) and from ``ChunkedFileSink``'s ``write_fn`` hook otherwise.

The number of faults injected, by kind, is printed at the end of the module.
"""

from __future__ import annotations

import collections
import errno
import os
import pickle
import random
import re
import resource
import select
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
import torch
from _procs import SAFETY_S
from conftest import Mlp, export, read_folder, reference_files
from executorch.exir import ExecutorchBackendConfig

import ptdstream
from ptdstream import ChunkedFileSink, IntegrityError, Source, StreamingNamedDataStore
from ptdstream.manager import plan_manager
from ptdstream.save import write_data_files
from ptdstream.write.set_writer import write_save_plan

PTD = "_default_external_constant.ptd"
TARGETS = (PTD, "model.pte")
TEMP_RE = r"\.(?:{names})\.ptdstream-\d+-[0-9a-f]{{8}}\.tmp"

#: Faults injected in this module, by kind (printed at the end).
FAULTS = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _print_fault_count(request):
    yield
    line = f"test_faults: {sum(FAULTS.values())} faults injected: " + ", ".join(
        f"{kind} {n}" for kind, n in sorted(FAULTS.items())
    )
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{line}")


@pytest.fixture(scope="module")
def old_manager():
    """The model whose complete files are already in the folder."""
    torch.manual_seed(1)
    return export(Mlp(), config=ExecutorchBackendConfig(external_constants=True))


@pytest.fixture(scope="module")
def manager():
    """The model being saved when the fault hits: a 640 KiB .ptd, a small .pte."""
    torch.manual_seed(0)
    model = Mlp(d_in=256, d_hidden=512, d_out=64)
    return export(model, config=ExecutorchBackendConfig(external_constants=True),
                  inputs=(torch.randn(2, 256),))


@pytest.fixture(scope="module")
def reference(manager, tmp_path_factory):
    """Upstream's files for ``manager``: what a successful save must give."""
    files = reference_files(manager, str(tmp_path_factory.mktemp("reference")))
    assert sorted(files) == sorted(TARGETS)
    return files


@pytest.fixture
def previous(old_manager, tmp_path):
    """A folder holding a previous complete save; returns (folder, its files)."""
    folder = tmp_path / "out"
    folder.mkdir()
    ptdstream.save(old_manager, str(folder / "model.pte"))
    files = read_folder(str(folder))
    assert sorted(files) == sorted(TARGETS)
    return folder, files


def assert_untouched(folder, before):
    """The previous files are byte-identical and nothing else is in ``folder``."""
    names = sorted(os.listdir(folder))
    assert names == sorted(before), f"stray files left: {sorted(set(names) - set(before))}"
    assert read_folder(str(folder)) == before


def run_in_child(fn, timeout_s: float = SAFETY_S):
    """Run ``fn()`` in a forked child (limits and uid changes stay there).

    Returns ``("ok", value)`` or ``("raised", {"type", "errno", "message"})``.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        status = 0
        try:
            os.close(r)
            try:
                payload = ("ok", fn())
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                payload = ("raised", {
                    "type": type(e).__name__,
                    "errno": getattr(e, "errno", None),
                    "message": str(e),
                })
            with os.fdopen(w, "wb") as f:
                pickle.dump(payload, f)
        except BaseException:  # noqa: BLE001 - any failure to report it: the child exits 70
            status = 70
        finally:
            os._exit(status)
    os.close(w)
    data = b""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([r], [], [], max(left, 0))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"child {pid} still running after {timeout_s} s; killed")
            piece = os.read(r, 1 << 16)
            if not piece:
                break
            data += piece
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, f"child {pid} died: status {status}"
    return pickle.loads(data)


def raised(result):
    kind, value = result
    assert kind == "raised", f"expected the save to fail, it returned {value!r}"
    return value


# --- the file system says no ------------------------------------------------


def test_file_size_limit_fails_mid_file_with_efbig(previous, manager):
    folder, before = previous
    limit = 256 * 1024 + 7  # inside the .ptd's first segment, not on a piece boundary

    def save_under_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        ptdstream.save(manager, str(folder / "model.pte"))

    error = raised(run_in_child(save_under_limit))
    FAULTS["EFBIG (RLIMIT_FSIZE)"] += 1
    assert error["type"] == "OSError" and error["errno"] == errno.EFBIG
    # The kernel wrote up to the limit (a short write), then refused the rest.
    ptd = re.escape(str(folder / PTD))
    assert re.search(
        rf"writing {re.escape(str(folder))}/{TEMP_RE.format(names=re.escape(PTD))} "
        rf"\(for {ptd}\) at offset {limit}: File too large",
        error["message"],
    ), error["message"]
    assert_untouched(folder, before)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 512 KiB tmpfs (needs root and mount rights; skips otherwise)."""
    point = tmp_path / "tmpfs"
    point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(point)],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield point
    finally:
        if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True)


def test_full_disk_fails_with_enospc_and_frees_the_space(small_tmpfs, old_manager, manager):
    folder = small_tmpfs
    ptdstream.save(old_manager, str(folder / "model.pte"))
    before = read_folder(str(folder))
    free_before = os.statvfs(folder).f_bavail

    with pytest.raises(OSError) as err:
        ptdstream.save(manager, str(folder / "model.pte"))
    FAULTS["ENOSPC (full tmpfs)"] += 1

    assert err.value.errno == errno.ENOSPC
    message = str(err.value)
    match = re.search(
        rf"writing {re.escape(str(folder))}/{TEMP_RE.format(names=re.escape(PTD))} "
        rf"\(for {re.escape(str(folder / PTD))}\) at offset (\d+): No space left on device",
        message,
    )
    assert match, message
    assert 0 < int(match.group(1)) <= 512 * 1024
    assert_untouched(folder, before)
    assert os.statvfs(folder).f_bavail == free_before, "the temp file's blocks were freed"


@pytest.fixture
def unwritable_folder(tmp_path):
    """``(folder, as_root)``: an empty folder the test fills, then makes read-only.

    Root ignores permissions, so as root the save runs in a child that drops to
    ``nobody``, and the folder lies under the system temp dir (``nobody`` cannot
    reach pytest's). The test skips when the saver can still write the folder.
    """
    as_root = os.geteuid() == 0
    base = tempfile.mkdtemp(prefix="ptdstream-ro-") if as_root else str(tmp_path)
    folder = os.path.join(base, "ro")
    os.mkdir(folder)
    try:
        if as_root:
            os.chmod(base, 0o755)
        yield folder, as_root
    finally:
        os.chmod(folder, 0o700)
        if as_root:
            shutil.rmtree(base)


def test_unwritable_folder_fails_before_writing(unwritable_folder, old_manager, manager):
    folder, as_root = unwritable_folder
    ptdstream.save(old_manager, os.path.join(folder, "model.pte"))
    before = read_folder(folder)
    os.chmod(folder, 0o555)

    def save_without_rights():
        # Plan first (it reads executorch's schema files, which ``nobody`` may not
        # reach where the venv lies in a private folder), then write without rights.
        plan = plan_manager(manager, os.path.join(folder, "model.pte"))
        if as_root:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        if os.access(folder, os.W_OK):
            return "writable"
        write_save_plan(plan)
        return "saved"

    result = run_in_child(save_without_rights) if as_root else _call(save_without_rights)
    if result == ("ok", "writable"):
        pytest.skip("this user ignores folder permissions (os.access says writable)")
    error = raised(result)
    FAULTS["EACCES (read-only folder)"] += 1
    assert error["type"] == "PermissionError" and error["errno"] == errno.EACCES
    assert f"for {os.path.join(folder, PTD)}" in error["message"], error["message"]
    assert_untouched(folder, before)


def _call(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the outcome, whatever it is, goes to the caller
        return ("raised", {"type": type(e).__name__, "errno": getattr(e, "errno", None),
                           "message": str(e)})


# --- faults through the write_fn hook ------------------------------------------


class FaultyWrites:
    """An ``os.write`` stand-in shared by every sink of a save.

    Args:
        fail_at_nbytes: raise ``OSError(code)`` once this many bytes were written
            in all (the sink sees a short write first when a call crosses it).
        short: write a random 1..len bytes per call (seeded).
        interrupt_every: raise ``InterruptedError`` before every n-th call.
    """

    def __init__(self, *, fail_at_nbytes=None, code=errno.EIO, short=False,
                 interrupt_every=0, seed=0):
        self.fail_at_nbytes = fail_at_nbytes
        self.code = code
        self.short = short
        self.interrupt_every = interrupt_every
        self.rng = random.Random(seed)
        self.nbytes = 0
        self.calls = 0
        self.faults = collections.Counter()

    def __call__(self, fd, view):
        self.calls += 1
        if self.interrupt_every and self.calls % self.interrupt_every == 0:
            self.faults["EINTR"] += 1
            raise InterruptedError(errno.EINTR, os.strerror(errno.EINTR))
        want = len(view)
        if self.fail_at_nbytes is not None:
            room = self.fail_at_nbytes - self.nbytes
            if room <= 0:
                self.faults[errno.errorcode[self.code]] += 1
                raise OSError(self.code, os.strerror(self.code))
            want = min(want, room)
        if self.short and want > 1:
            want = self.rng.randint(1, want)
        n = os.write(fd, view[:want])
        if n < len(view):
            self.faults["short write"] += 1
        self.nbytes += n
        return n

    def factory(self, target):
        return ChunkedFileSink(target, write_fn=self)


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
@pytest.mark.parametrize("where", ["ptd", "pte"])
def test_write_error_names_the_file_and_offset_and_publishes_nothing(
        previous, manager, reference, code, where):
    folder, before = previous
    ptd_nbytes = len(reference[PTD])
    # In the .ptd's payload, or in the .pte after the whole .ptd was written and synced.
    fail_at, target, offset = (
        (300_001, PTD, 300_001) if where == "ptd" else (ptd_nbytes + 100, "model.pte", 100)
    )
    writes = FaultyWrites(fail_at_nbytes=fail_at, code=code)
    plan = plan_manager(manager, str(folder / "model.pte"))

    with pytest.raises(OSError) as err:
        write_save_plan(plan, sink_factory=writes.factory)
    FAULTS.update(writes.faults)

    assert writes.faults[errno.errorcode[code]] == 1
    assert err.value.errno == code
    assert re.fullmatch(
        rf"\[Errno {code}\] writing {re.escape(str(folder))}/"
        rf"{TEMP_RE.format(names=re.escape(target))} \(for {re.escape(str(folder / target))}\) "
        rf"at offset {offset}: {re.escape(os.strerror(code))}",
        str(err.value),
    ), str(err.value)
    assert_untouched(folder, before)


def test_fsync_error_names_the_file_and_publishes_nothing(previous, manager, monkeypatch):
    folder, before = previous
    real_fsync = os.fsync
    failed = []

    def failing_fsync(fd):
        if ".ptdstream-" in os.readlink(f"/proc/self/fd/{fd}"):
            failed.append(fd)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError) as err:
        ptdstream.save(manager, str(folder / "model.pte"))
    monkeypatch.undo()
    FAULTS["EIO (fsync)"] += len(failed)

    assert len(failed) == 1 and err.value.errno == errno.EIO
    assert f"(for {folder / PTD})" in str(err.value), str(err.value)
    assert "Input/output error" in str(err.value)
    assert_untouched(folder, before)


def test_short_writes_still_give_the_reference_bytes(previous, manager, reference):
    folder, _ = previous
    writes = FaultyWrites(short=True, seed=7)
    plan = plan_manager(manager, str(folder / "model.pte"))
    write_save_plan(plan, sink_factory=writes.factory)
    FAULTS.update(writes.faults)
    assert writes.faults["short write"] > 50
    assert read_folder(str(folder)) == reference


def test_interrupted_writes_are_retried(previous, manager, reference):
    """``InterruptedError`` from the write function is retried, as ``io`` does (PEP 475)."""
    folder, _ = previous
    writes = FaultyWrites(short=True, interrupt_every=3, seed=3)
    plan = plan_manager(manager, str(folder / "model.pte"))
    write_save_plan(plan, sink_factory=writes.factory)
    FAULTS.update(writes.faults)
    assert writes.faults["EINTR"] > 10 and writes.faults["short write"] > 10
    assert read_folder(str(folder)) == reference


def test_sink_retries_interrupted_writes_with_nothing_lost(tmp_path):
    writes = FaultyWrites(short=True, interrupt_every=2, seed=11)
    data = bytes(range(256)) * 4096  # 1 MiB
    with ChunkedFileSink(str(tmp_path / "a.bin"), write_fn=writes) as sink:
        sink.write(data)
        sink.write_zeros(3000)
    FAULTS.update(writes.faults)
    assert writes.faults["EINTR"] == writes.calls // 2 > 5
    assert (tmp_path / "a.bin").read_bytes() == data + bytes(3000)
    assert os.listdir(tmp_path) == ["a.bin"]


def test_signals_during_a_save_change_nothing(previous, manager, reference):
    """A 1 kHz SIGALRM (Python handler) while saving: the save completes, bytes exact."""
    folder, _ = previous
    delivered = []
    old = signal.signal(signal.SIGALRM, lambda *_: delivered.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
        deadline = time.monotonic() + 10
        saves = 0
        while len(delivered) < 20 and time.monotonic() < deadline:
            ptdstream.save(manager, str(folder / "model.pte"), chunk_nbytes=4096)
            saves += 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
    FAULTS["SIGALRM"] += len(delivered)
    assert len(delivered) >= 20, f"only {len(delivered)} signals in {saves} saves"
    assert read_folder(str(folder)) == reference


# --- a source that fails -------------------------------------------------------------


class BrokenSource(Source):
    """``nbytes`` bytes whose reading fails after the first piece (a device gone)."""

    is_mutable = False  # immutable bytes: not digested as it is handed over, so it fails at the write

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.nbytes = len(data)
        self.pieces_given = 0

    def describe(self) -> str:
        return "a disk that goes away"

    def prefix(self, nbytes: int = 32) -> bytes:
        return self._data[:nbytes]

    def pieces(self, ring):
        view = memoryview(self._data)
        self.pieces_given += 1
        yield view[: ring.chunk_nbytes]
        raise OSError(errno.EIO, "the disk went away")


def test_source_failing_mid_stream_is_an_integrity_error_naming_the_key(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    before = {"a.ptd": b"previous a.ptd", "b.ptd": b"previous b.ptd"}
    for name, data in before.items():
        (folder / name).write_bytes(data)
    broken = BrokenSource(bytes(range(256)) * 64)  # 16 KiB, 4 pieces of 4 KiB
    store = StreamingNamedDataStore()
    store.add_named_data("good", bytes(5000), alignment=16, external_tag="a")
    store.add_named_data("also.good", b"\x01" * 3000, alignment=16, external_tag="b")
    store.add_named_data("layer.weight", broken, alignment=64, external_tag="b")

    with pytest.raises(IntegrityError) as err:
        write_data_files(store, str(folder), chunk_nbytes=4096)
    FAULTS["source raised"] += 1

    assert broken.pieces_given == 1
    message = str(err.value)
    assert "(key 'layer.weight') of b.ptd at offset " in message, message
    assert ("reading the source failed (OSError: [Errno 5] the disk went away); "
            "nothing was published") in message
    assert isinstance(err.value.__cause__, OSError)
    assert_untouched(folder, before)


# --- bad paths -----------------------------------------------------------------------


@pytest.mark.parametrize("which", ["model.pte", PTD])
def test_target_that_is_a_directory_is_refused_and_nothing_is_published(
        previous, manager, which):
    folder, before = previous
    os.unlink(folder / which)
    (folder / which).mkdir()
    del before[which]

    with pytest.raises(IsADirectoryError) as err:
        ptdstream.save(manager, str(folder / "model.pte"))
    FAULTS["target is a directory"] += 1

    assert err.value.errno == errno.EISDIR
    assert str(folder / which) in str(err.value)
    assert sorted(os.listdir(folder)) == sorted([which, *before])
    assert os.listdir(folder / which) == []
    assert {n: (folder / n).read_bytes() for n in before} == before


def test_pte_folder_that_does_not_exist(tmp_path, manager):
    missing = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError) as err:
        ptdstream.save(manager, str(missing / "model.pte"))
    FAULTS["missing folder"] += 1
    assert err.value.errno == errno.ENOENT
    message = str(err.value)
    assert f"in folder {missing}" in message and "must exist" in message, message
    assert os.listdir(tmp_path) == [], "no folder is created"



def test_pte_folder_missing_with_data_dir_present_publishes_no_data_file(previous, manager):
    """The .ptd is written and synced in ``data_dir`` first; the .pte then fails: no .ptd appears."""
    folder, before = previous
    missing = folder.parent / "missing"
    with pytest.raises(FileNotFoundError) as err:
        ptdstream.save(manager, str(missing / "model.pte"), data_dir=str(folder))
    FAULTS["missing folder"] += 1
    assert f"for {missing / 'model.pte'} in folder {missing}" in str(err.value), str(err.value)
    assert not missing.exists()
    assert_untouched(folder, before)


class FailingPublish(ChunkedFileSink):
    """Renaming the .pte fails (a folder turned read-only, EIO on the folder)."""

    failed = 0

    def publish(self):
        if self.target.endswith(".pte"):
            FailingPublish.failed += 1
            raise OSError(errno.EIO, f"rename onto {self.target} failed")
        super().publish()


def test_failed_publish_of_the_pte_leaves_the_previous_set(previous, manager):
    folder, before = previous
    FailingPublish.failed = 0
    plan = plan_manager(manager, str(folder / "model.pte"))
    with pytest.raises(OSError, match="rename onto .*model.pte failed"):
        write_save_plan(plan, sink_factory=FailingPublish)
    FAULTS["EIO (rename)"] += FailingPublish.failed
    assert FailingPublish.failed == 1
    assert_untouched(folder, before)
