"""A source that changes between hand-over and the end of its write is refused
with IntegrityError naming the key; nothing is published (no torn output)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ptdstream import FileRangeSource, IntegrityError, StreamingNamedDataStore
from ptdstream.save import write_data_files

CHUNK = 64 << 10  # small pieces: each source spans several


def store_of(**items) -> StreamingNamedDataStore:
    store = StreamingNamedDataStore()
    for key, data in items.items():
        store.add_named_data(key, data, external_tag="w")
    return store


def on_piece(n: int, action):
    """A progress callback that runs ``action`` once, after the ``n``-th piece."""
    count = [0]

    def progress(nbytes):
        count[0] += 1
        if count[0] == n:
            action()

    return progress


def refused(store, folder, progress=None) -> str:
    with pytest.raises(IntegrityError) as err:
        write_data_files(store, str(folder), chunk_nbytes=CHUNK, progress=progress)
    assert os.listdir(folder) == []
    return str(err.value)


@pytest.mark.parametrize("kind", ["tensor", "bytearray"])
def test_a_change_after_hand_over_is_refused(tmp_path, kind):
    data = torch.arange(100_000, dtype=torch.float32) if kind == "tensor" else bytearray(os.urandom(400_000))
    store = store_of(weight=data)
    if kind == "tensor":
        data[50_000] = -1.0  # not in the first bytes: only a fingerprint sees it
    else:
        data[200_000] ^= 0xFF
    message = refused(store, tmp_path)
    assert "key 'weight'" in message and "changed after it was handed over" in message


@pytest.mark.parametrize("where", ["ahead", "behind"])
def test_a_change_during_the_write_is_refused(tmp_path, where):
    """Changed ahead of the writer (the file would mix old and new bytes), or
    behind it (already written: the save no longer matches the source)."""
    t = torch.zeros(200_000, dtype=torch.float32)  # 800 KB: 13 pieces
    store = store_of(a=torch.ones(10), weight=t)

    def change():
        t[190_000 if where == "ahead" else 100] = 7.0

    message = refused(store, tmp_path, on_piece(4, change))
    assert "key 'weight'" in message and "changed after it was handed over" in message


def test_a_tensor_written_by_another_thread_during_the_save_is_refused(tmp_path):
    t = torch.zeros(1 << 20, dtype=torch.float32)  # 4 MiB
    store = store_of(weight=t)
    stop = threading.Event()
    started = threading.Event()

    def writer():
        i = 1  # its first write changes the tensor (0.0 into a zero would not): started means changed
        while not stop.is_set():
            t[(i * 4099) % t.numel()] = float(i)
            i += 1
            started.set()

    thread = threading.Thread(target=writer)
    thread.start()
    started.wait()
    try:
        message = refused(store, tmp_path)
    finally:
        stop.set()
        thread.join()
    assert "key 'weight'" in message


def test_an_unchanged_mutable_source_is_written(tmp_path):
    t = torch.arange(100_000, dtype=torch.float32)
    write_data_files(store_of(weight=t, raw=bytearray(b"abc" * 1000)), str(tmp_path), chunk_nbytes=CHUNK)
    assert os.listdir(tmp_path) == ["w.ptd"]


def test_a_file_rewritten_in_place_mid_save_is_refused(tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"a" * 300_000)
    out = tmp_path / "out"
    out.mkdir()
    store = store_of(**{"weights.blob": FileRangeSource(str(blob))})

    def rewrite():
        with open(blob, "r+b") as f:  # same size, same inode, new bytes at the end
            f.seek(250_000)
            f.write(b"b" * 50_000)

    message = refused(store, out, on_piece(2, rewrite))
    assert "'weights.blob'" in message and f"file {blob}: changed while it was read" in message


def test_a_file_replaced_after_hand_over_is_refused(tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"a" * 1000)
    out = tmp_path / "out"
    out.mkdir()
    store = store_of(**{"weights.blob": FileRangeSource(str(blob))})
    (tmp_path / "new.bin").write_bytes(b"a" * 999 + b"b")
    os.replace(tmp_path / "new.bin", blob)
    message = refused(store, out)
    assert f"file {blob}: replaced before it was read" in message
