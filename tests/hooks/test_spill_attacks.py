"""brk2 adversarial probes of ptdstream.hooks.cuda.spill (claims 1a-1f)."""

from __future__ import annotations

import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from conftest import skip_unless_pages_can_drop
from hypothesis import given, settings
from hypothesis import strategies as st

from ptdstream import StreamingNamedDataStore
from ptdstream.errors import IntegrityError
from ptdstream.hooks.cuda import spill as spill_module
from ptdstream.hooks.cuda.spill import SPILL_ALIGNMENT, SpillFile
from ptdstream.save import write_data_files
from ptdstream.sources import BufferRing, MemorySource
from ptdstream.system.pagecache import resident_nbytes


def _read(source, chunk):
    return b"".join(bytes(p) for p in source.pieces(BufferRing(chunk, count=2)))


SIZES = [0, 1, 7, 4095, 4096, 4097, 8191, 8192, 65537, 0, 3, 1 << 20, (1 << 20) + 1, 0]


@pytest.mark.parametrize("ring", [1, 3, 4095, 4096, 4097, 1 << 16, 2 << 20])
def test_brk2_many_appends_of_every_size_read_back_exactly(tmp_path, ring):
    spill = SpillFile(str(tmp_path), window_nbytes=1 << 16)
    if ring == 1:
        sizes = [s for s in SIZES if s < 70_000]
    else:
        sizes = SIZES
    datas = [os.urandom(n) for n in sizes]
    sources = [spill.append(MemorySource(d), f"s{i}", chunk_nbytes=max(1, (i * 997) % 9000 + 1))
               for i, d in enumerate(datas)]
    assert os.listdir(tmp_path) == []
    for d, s in zip(datas, sources, strict=True):
        assert s.nbytes == len(d) and s.offset % SPILL_ALIGNMENT == 0
        assert _read(s, ring) == d
        for k in (0, 1, 32, len(d), len(d) + 5):
            assert s.prefix(k) == d[:k]


def test_brk2_fallback_without_o_tmpfile_leaves_no_name(tmp_path, monkeypatch):
    real_open = os.open

    def no_tmpfile(path, flags, *a, **k):
        if flags & getattr(os, "O_TMPFILE", 0) == getattr(os, "O_TMPFILE", -1):
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(spill_module.os, "open", no_tmpfile)
    spill = SpillFile(str(tmp_path))
    s = spill.append(MemorySource(b"abc" * 5000), "x")
    assert os.listdir(tmp_path) == []
    assert _read(s, 100) == b"abc" * 5000


@pytest.mark.parametrize("tmpfile", [True, False])
def test_brk2_nothing_left_after_sigkill_mid_append(tmp_path, tmpfile):
    code = textwrap.dedent(f"""
        import os, signal, errno
        from ptdstream.sources import MemorySource
        from ptdstream.hooks.cuda import spill as m
        if not {tmpfile}:
            real = os.open
            def no_tmpfile(p, f, *a, **k):
                if f & os.O_TMPFILE == os.O_TMPFILE:
                    raise OSError(errno.EOPNOTSUPP, "no")
                return real(p, f, *a, **k)
            m.os.open = no_tmpfile
        class Killer(MemorySource):
            def pieces(self, ring):
                yield memoryview(b"a" * 5000)
                os.kill(os.getpid(), signal.SIGKILL)
        sp = m.SpillFile({str(tmp_path)!r})
        sp.append(MemorySource(b"x" * 10000), "first")
        sp.append(Killer(b"b" * 20000), "killed")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert os.listdir(tmp_path) == []


def _open_on(fd: int, path, flags: int) -> int:
    """``path`` opened on the descriptor number ``fd``, closed just before. open()
    gives the lowest free number: ``fd``, unless a lower one was freed meanwhile
    (the GC closing a file object another test left), then the file is moved there."""
    opened = os.open(path, flags)
    if opened == fd:
        return fd
    try:
        os.fstat(fd)
    except OSError:  # still free
        os.dup2(opened, fd)
        return fd
    finally:
        os.close(opened)
    pytest.fail(f"descriptor {fd} was taken by another open meanwhile")


def test_brk2_a_closed_spill_file_is_not_read_through_a_reused_descriptor(tmp_path):
    """SpillFile.close() says its sources 'can no longer be read'; but the fd number
    is reused by the next open() and the source then reads that other file."""
    spill = SpillFile(str(tmp_path))
    source = spill.append(MemorySource(b"spilled bytes"), "s")
    fd = spill.fileno()
    spill.close()
    other = tmp_path / "other"
    other.write_bytes(b"SOMEONE ELSE'S FILE")
    reused = _open_on(fd, other, os.O_RDONLY)  # the descriptor number came back
    try:
        with pytest.raises((OSError, IntegrityError, ValueError)):
            got = source.prefix(13)
            # it must not hand out another file's bytes
            raise AssertionError(f"prefix read {got!r} from {other} through the reused fd {fd}")
    finally:
        os.close(reused)


def test_brk2_descriptor_open_until_last_source_gone_with_many_sources(tmp_path):
    spill = SpillFile(str(tmp_path))
    fd = spill.fileno()
    srcs = [spill.append(MemorySource(bytes([i]) * 10), f"s{i}") for i in range(5)]
    del spill
    for _ in range(4):
        srcs.pop(0)
        gc.collect()
        os.fstat(fd)
        assert _read(srcs[-1], 3) == bytes([4]) * 10
    srcs.clear()
    gc.collect()
    with pytest.raises(OSError) as e:
        os.fstat(fd)
    assert e.value.errno == errno.EBADF


def _writeback_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ptdstream")]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, ValueError])
def test_brk2_no_thread_outlives_an_append_interrupted_mid_way(tmp_path, exc):
    before = _writeback_threads()

    class Bad(MemorySource):
        def pieces(self, ring):
            for _ in range(40):
                yield memoryview(b"z" * 4096)
            raise exc("stop")

    spill = SpillFile(str(tmp_path), window_nbytes=8192)
    kept = spill.append(MemorySource(b"k" * 100), "kept")
    with pytest.raises(exc):
        spill.append(Bad(b"z" * (50 * 4096)), "bad")
    assert _writeback_threads() == before
    assert _read(kept, 7) == b"k" * 100
    after = spill.append(MemorySource(b"q" * 9), "after")
    assert _read(after, 4) == b"q" * 9 and _read(kept, 64) == b"k" * 100


def test_brk2_keyboardinterrupt_inside_the_write_leaves_no_thread(tmp_path, monkeypatch):
    before = _writeback_threads()
    real = spill_module.pwrite_all
    calls = []

    def interrupted(fd, view, offset):
        calls.append(offset)
        if len(calls) == 30:
            raise KeyboardInterrupt
        return real(fd, view, offset)

    monkeypatch.setattr(spill_module, "pwrite_all", interrupted)
    spill = SpillFile(str(tmp_path), window_nbytes=8192)
    with pytest.raises(KeyboardInterrupt):
        spill.append(MemorySource(b"y" * (100 * 4096)), "ki", chunk_nbytes=4096)
    assert _writeback_threads() == before


def test_brk2_a_source_longer_than_it_said_is_refused(tmp_path):
    class Long(MemorySource):
        def pieces(self, ring):
            yield memoryview(b"abcde")
            yield memoryview(b"fg")

    spill = SpillFile(str(tmp_path))
    with pytest.raises(IntegrityError, match=r"long: .* gave more than the 5 bytes it said"):
        spill.append(Long(b"abcde"), "long")
    s = spill.append(MemorySource(b"ok"), "ok")
    assert s.offset == 0 and _read(s, 1) == b"ok"


_FSIZE_CHILD = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from ptdstream.sources import MemorySource, BufferRing
from ptdstream.hooks.cuda.spill import SpillFile
folder = sys.argv[1]
sp = SpillFile(folder)
kept = sp.append(MemorySource(b"k" * 5000), "kept")
resource.setrlimit(resource.RLIMIT_FSIZE, (8192 + 1500, resource.RLIM_INFINITY))
try:
    sp.append(MemorySource(b"x" * 20000), "big", chunk_nbytes=8000)
except OSError as e:
    print("ERRNO", e.errno)
    print("MSG", e)
back = b"".join(bytes(p) for p in kept.pieces(BufferRing(999)))
print("KEPT", back == b"k" * 5000)
"""


def test_brk2_a_real_efbig_names_folder_and_the_failing_offset(tmp_path):
    """A real short write then EFBIG (RLIMIT_FSIZE): the first 1500 bytes of the piece at
    8192 are written, the pwrite at 9692 fails. The message should name 9692."""
    p = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(tmp_path)], capture_output=True, text=True)
    out = p.stdout
    assert f"ERRNO {errno.EFBIG}" in out, (out, p.stderr[-2000:])
    assert f"in {tmp_path} at offset" in out
    assert "KEPT True" in out
    assert "at offset 9692 failed" in out, out


def test_brk2_a_missing_spill_folder_is_reported_as_the_spill_folder():
    missing = "/nonexistent-brk2/spill"
    with pytest.raises(OSError) as e:
        SpillFile(missing)
    assert e.value.errno == errno.ENOENT
    # The error should say which folder (not a made-up temp-file name) and what for.
    assert missing in str(e.value) and "spill" in str(e.value).lower()
    assert ".ptdstream-spill-" not in str(e.value), str(e.value)


def test_brk2_changed_or_truncated_spill_refused_naming_key_and_existing_file_unchanged(tmp_path):
    data = os.urandom(70_000)
    spill = SpillFile(str(tmp_path))
    src = spill.append(MemorySource(data), "storage of w0")
    out = tmp_path / "out"
    out.mkdir()
    good = StreamingNamedDataStore()
    good.add_named_data("w0", src, alignment=64, external_tag="w")
    write_data_files(good, str(out))
    before = (out / "w.ptd").read_bytes()
    os.pwrite(spill.fileno(), bytes([data[69_999] ^ 0xFF]), src.offset + 69_999)  # always a different byte
    bad = StreamingNamedDataStore()
    bad.add_named_data("w0", src, alignment=64, external_tag="w")
    with pytest.raises(IntegrityError, match="w0"):
        write_data_files(bad, str(out))
    assert (out / "w.ptd").read_bytes() == before and sorted(os.listdir(out)) == ["w.ptd"]
    os.ftruncate(spill.fileno(), src.offset + 100)
    bad2 = StreamingNamedDataStore()
    bad2.add_named_data("w0", src, alignment=64, external_tag="w")
    with pytest.raises(IntegrityError, match="w0"):
        write_data_files(bad2, str(out))
    assert (out / "w.ptd").read_bytes() == before and sorted(os.listdir(out)) == ["w.ptd"]


@pytest.mark.parametrize("chunk", [1 << 20, 3 << 20, (1 << 20) + 4097, 64 << 10])
def test_brk2_little_cached_after_spill_and_read_with_odd_sizes(tmp_path, chunk):
    skip_unless_pages_can_drop(tmp_path)
    spill = SpillFile(str(tmp_path), window_nbytes=1 << 20)
    spill.append(MemorySource(os.urandom(5000)), "head")  # later ranges start off a 2 MiB block
    src = spill.append(MemorySource(os.urandom(24 << 20)), "big", chunk_nbytes=chunk)
    tail = spill.append(MemorySource(os.urandom(3 << 20)), "tail", chunk_nbytes=chunk)
    proc = f"/proc/self/fd/{spill.fileno()}"
    assert resident_nbytes(proc) <= 1 << 20
    for _ in src.pieces(BufferRing(chunk, count=2)):
        pass
    assert resident_nbytes(proc) <= 10 << 20
    assert src.prefix(32) and tail.prefix(32)
    assert resident_nbytes(proc) <= 10 << 20


def test_brk2_append_after_close_does_not_write_into_another_file(tmp_path):
    """After SpillFile.close(), append() pwrites to the closed descriptor number:
    once reused by another open file, that file is overwritten."""
    spill = SpillFile(str(tmp_path))
    fd = spill.fileno()
    spill.close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious user data")
    reused = _open_on(fd, victim, os.O_RDWR)
    try:
        try:
            spill.append(MemorySource(b"SPILL"), "late")
        except (OSError, ValueError, IntegrityError):
            pass
    finally:
        os.close(reused)
    assert victim.read_bytes() == b"precious user data"


class _Fails(MemorySource):
    def __init__(self, data, after):
        super().__init__(data)
        self.after = after

    def pieces(self, ring):
        done = 0
        for p in super().pieces(ring):
            if done + len(p) > self.after:
                raise ValueError("source failed")
            done += len(p)
            yield p


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20_000), st.integers(1, 9000), st.booleans(), st.integers(0, 20_000)),
                min_size=1, max_size=12),
       st.integers(1, 12_000))
def test_brk2_fuzz_appends_with_failures_read_back_exactly(tmp_path_factory, plan, ring):
    folder = tmp_path_factory.mktemp("fz")
    spill = SpillFile(str(folder), window_nbytes=8192)
    good = []
    for i, (n, chunk, fail, after) in enumerate(plan):
        data = os.urandom(n)
        if fail and after < n:
            with pytest.raises(ValueError):
                spill.append(_Fails(data, after), f"f{i}", chunk_nbytes=chunk)
            continue
        good.append((spill.append(MemorySource(data), f"s{i}", chunk_nbytes=chunk), data))
    for s, d in good:
        assert _read(s, ring) == d and s.prefix(40) == d[:40]
    offsets = [s.offset for s, _ in good]
    assert offsets == sorted(offsets)
    assert os.listdir(folder) == []


def test_brk2_a_read_error_of_the_source_is_not_reported_as_a_spill_write_error(tmp_path):
    """The source fails to read its own file (OSError naming /data/model.bin). append()
    catches every OSError of the loop and re-raises it as 'spilling ... to an unlinked temp
    file in <folder> ... failed: <strerror>': the source's file name is lost and the
    spill folder is blamed."""

    class Unreadable(MemorySource):
        def pieces(self, ring):
            yield memoryview(b"a" * 10)
            raise OSError(errno.EIO, "Input/output error", "/data/model.bin")

    with pytest.raises(OSError) as e:
        SpillFile(str(tmp_path)).append(Unreadable(b"a" * 20), "w")
    assert "/data/model.bin" in str(e.value), str(e.value)


def test_brk2_a_source_longer_than_it_said_is_refused_before_it_fills_the_disk(tmp_path):
    """A source that says 5 bytes and keeps yielding: append() writes every byte it gets
    (here 1000 x 4 KiB; a runaway source fills the spill folder) and refuses only at the end."""
    taken = []

    class Runaway(MemorySource):
        def pieces(self, ring):
            for i in range(1000):
                taken.append(i)
                yield memoryview(b"r" * 4096)

    spill = SpillFile(str(tmp_path))
    with pytest.raises(IntegrityError):
        spill.append(Runaway(b"abcde"), "runaway")
    assert len(taken) <= 2, f"{len(taken)} pieces ({len(taken) * 4096} bytes) written for a 5-byte source"
