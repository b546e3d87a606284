"""Fuzz pack / unpack / the seekable reader: round trips of any content and frame
size, and corrupt input that must either fail with FormatError / IntegrityError
(nothing published, nothing left behind) or give back exactly the original bytes."""

from __future__ import annotations

import os
import random
import struct
import tempfile

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptdstream import FormatError, IntegrityError
from ptdstream.pack import PackedArtifact, pack, plan_frames, unpack
from ptdstream.pack.seekable import SeekableReader

pytestmark = pytest.mark.fuzz
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OURS = (FormatError, IntegrityError)

# Runs of repeated bytes and random chunks: compressible and incompressible frames.
content = st.lists(
    st.one_of(st.binary(max_size=600), st.tuples(st.integers(0, 255), st.integers(1, 3000)).map(
        lambda run: bytes([run[0]]) * run[1])),
    max_size=8,
).map(b"".join)


def write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@FAST
@given(data=content, frame_nbytes=st.integers(64, 5000), threads=st.integers(1, 3),
       checksums=st.booleans(), level=st.sampled_from([-3, 1, 3, 12]), ranges=st.data())
def test_any_content_round_trips_and_reads_at_any_offset(data, frame_nbytes, threads, checksums, level, ranges):
    with tempfile.TemporaryDirectory() as d:
        src, zst, out = (os.path.join(d, n) for n in ("in", "in.zst", "out"))
        write(src, data)
        report = pack(src, zst, frame_nbytes=frame_nbytes, threads=threads, checksums=checksums, level=level)
        assert report.nbytes == len(data)
        assert report.frames == len(plan_frames(len(data), frame_nbytes, report.head_nbytes))
        assert zstandard.ZstdDecompressor().stream_reader(read(zst), read_across_frames=True).read() == data
        assert unpack(zst, out).nbytes == len(data) and read(out) == data
        with SeekableReader(zst) as reader:
            for _ in range(3):
                offset = ranges.draw(st.integers(0, len(data)))
                nbytes = ranges.draw(st.integers(0, len(data) - offset))
                assert reader.read_at(offset, nbytes) == data[offset : offset + nbytes]
        assert sorted(os.listdir(d)) == ["in", "in.zst", "out"]


def _sample():
    """A packed .ptd-like file: a 64-byte FT head, then mixed content, 10 frames."""
    head = b"\0" * 4 + b"FT01" + b"\0" * 56
    rng = random.Random(0)
    body = b"".join(bytes([i]) * 700 + rng.randbytes(300) + struct.pack("<I", i) * 50 for i in range(8))
    with tempfile.TemporaryDirectory() as d:
        write(os.path.join(d, "in"), head + body)
        pack(os.path.join(d, "in"), os.path.join(d, "in.zst"), frame_nbytes=1024)
        return head + body, read(os.path.join(d, "in.zst"))


ORIGINAL, PACKED = _sample()


def _frame_starts(packed: bytes):
    """Offsets of the data frames (decompressed size > 0), from the seek table."""
    count, descriptor, _ = struct.unpack_from("<IBI", packed, len(packed) - 9)
    entry = 12 if descriptor & 0x80 else 8
    table = len(packed) - (8 + count * entry + 9)
    starts, c_off = [], 0
    for i in range(count):
        c_n, d_n = struct.unpack_from("<II", packed, table + 8 + i * entry)
        if d_n:
            starts.append(c_off)
        c_off += c_n
    return starts


FRAME_STARTS = _frame_starts(PACKED)


def _unused_bits(position: int, mask: int) -> bool:
    """Bits that the formats tell decoders not to interpret: bit 4 of a zstd frame
    header descriptor, bits 1-0 of the seek table descriptor."""
    return (mask == 0x10 and position - 4 in FRAME_STARTS) or (position == len(PACKED) - 5 and mask < 4)


def _unpack_bytes(packed: bytes):
    """(output bytes, None) or (None, the error); checks nothing is published on error."""
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "p.zst"), os.path.join(d, "out")
        write(src, packed)
        try:
            unpack(src, out)
        except OURS as e:
            assert os.listdir(d) == ["p.zst"]
            return None, e
        return read(out), None


@settings(max_examples=200, deadline=None)
@given(position=st.integers(0, len(PACKED) - 1), mask=st.integers(1, 255))
def test_every_flipped_byte_fails_cleanly_unless_it_is_an_unused_bit(position, mask):
    bad = bytearray(PACKED)
    bad[position] ^= mask
    out, error = _unpack_bytes(bytes(bad))
    if _unused_bits(position, mask):
        assert error is None and out == ORIGINAL
    else:
        assert error is not None, f"flip 0x{mask:02x} at {position} went unnoticed"
        assert "p.zst" in str(error)


@pytest.mark.parametrize("position", [FRAME_STARTS[1] + 4, len(PACKED) - 5])
def test_unused_bits_are_not_interpreted(position):
    bad = bytearray(PACKED)
    bad[position] ^= 0x10 if position < len(PACKED) - 5 else 0x03
    assert _unpack_bytes(bytes(bad)) == (ORIGINAL, None)


@FAST
@given(cut=st.integers(1, len(PACKED)))
def test_a_truncated_file_always_fails(cut):
    out, error = _unpack_bytes(PACKED[:-cut])
    assert error is not None


@FAST
@given(prefix=st.binary(max_size=300), entries=st.lists(st.tuples(st.integers(0, 2**32 - 1),
       st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)), max_size=6),
       count_delta=st.integers(-2, 2), descriptor=st.sampled_from([0, 0x80, 0x81, 0x84]))
def test_random_seek_tables_only_raise_format_or_integrity_errors(prefix, entries, count_delta, descriptor):
    fmt = "<III" if descriptor & 0x80 else "<II"
    body = b"".join(struct.pack(fmt, *e[: len(fmt) - 1]) for e in entries)
    count = max(0, len(entries) + count_delta)
    table = struct.pack("<II", 0x184D2A5E, len(body) + 9) + body + struct.pack("<IBI", count, descriptor, 0x8F92EAB1)
    out, error = _unpack_bytes(prefix + table)
    assert error is not None or out == b""


@FAST
@given(position=st.integers(0, len(PACKED) - 1), mask=st.integers(1, 255))
def test_random_access_on_a_corrupt_file_raises_only_our_errors(position, mask):
    bad = bytearray(PACKED)
    bad[position] ^= mask
    with tempfile.TemporaryDirectory() as d:
        write(os.path.join(d, "p.zst"), bytes(bad))
        try:
            with SeekableReader(os.path.join(d, "p.zst")) as reader:
                assert reader.read_at(100, 3000) == ORIGINAL[100:3100]
        except OURS:
            pass
        try:
            PackedArtifact(os.path.join(d, "p.zst")).close()
        except OURS:
            pass
