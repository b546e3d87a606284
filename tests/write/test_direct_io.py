"""O_DIRECT staging blocks written by several I/O threads: bytes, order, faults."""

from __future__ import annotations

import errno
import os
import random

import pytest

from ptdstream.write.direct_io import DirectBlockWriter
from ptdstream.write.sink import ChunkedFileSink


def _chunks(seed, sizes):
    rng = random.Random(seed)
    return [rng.randbytes(n) for n in sizes]


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_blocks_written_out_of_order_give_the_bytes_in_order(tmp_path, depth):
    chunks = _chunks(depth, [1, 8191, 4096, 50_000, 3, 12_288, 70_001])
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    writer = DirectBlockWriter(fd, str(path), block_nbytes=8192, depth=depth, alignment=4096)
    for c in chunks:
        writer.write(memoryview(c))
    total = sum(map(len, chunks))
    assert writer.nbytes == total
    assert writer.finish() is True  # 145_600 bytes: the last block is padded to 4096
    writer.close()
    writer.close()
    os.ftruncate(fd, total)
    os.close(fd)
    assert path.read_bytes() == b"".join(chunks)


def test_a_failed_direct_write_names_the_file_and_offset_and_publishes_nothing(tmp_path):
    calls = []

    def failing_pwrite(fd, view, offset):
        calls.append(offset)
        if offset == 16 << 20:
            raise OSError(errno.EIO, "I/O error")
        return os.pwrite(fd, view[: len(view) // 2 or 1], offset)  # short writes too

    target = tmp_path / "d.bin"
    data = _chunks(0, [(40 << 20) + 5])[0]
    with pytest.raises(OSError, match=r"d\.bin.*at offset 16777216: Input/output error") as info:
        with ChunkedFileSink(str(target), direct=True, pwrite_fn=failing_pwrite) as sink:
            if not sink.direct:
                pytest.skip("this file system refuses O_DIRECT")
            sink.write(data)
    assert info.value.errno == errno.EIO
    assert os.listdir(tmp_path) == []
    assert 16 << 20 in calls


def test_direct_sink_with_one_and_several_writes_in_flight_gives_the_same_file(tmp_path):
    data = _chunks(1, [(17 << 20) + 77, 4096, 1])
    files = []
    for depth in (1, 4):
        target = tmp_path / f"d{depth}.bin"
        with ChunkedFileSink(str(target), direct=True, direct_depth=depth) as sink:
            for c in data:
                sink.write(c)
        files.append(target.read_bytes())
    assert files[0] == files[1] == b"".join(data)
