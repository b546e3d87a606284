"""StreamingNamedDataStore gives upstream NamedDataStore's outputs and errors."""

from __future__ import annotations

import os

import pytest
import torch
from executorch.exir._serialize._cord import FileBackedData
from executorch.exir._serialize._named_data_store import NamedDataStore
from hypothesis import given, settings
from hypothesis import strategies as st

from ptdstream import BufferRing, StreamingNamedDataStore
from ptdstream.save import write_data_files

BLOBS = [b"", b"a" * 4, b"b" * 4, b"a" * 40, b"a" * 39 + b"c", bytes(range(64)), b"xyz"]
op = st.tuples(
    st.sampled_from(["w", "x", "y", "z", "k0"]),
    st.sampled_from(range(len(BLOBS))),
    st.sampled_from([None, 1, 16, 48, 0, -4]),
    st.sampled_from([None, "a", "b"]),
)


def _apply(store, ops, wrap=bytes):
    outcomes = []
    for key, blob, alignment, tag in ops:
        try:
            store.add_named_data(key, wrap(BLOBS[blob]), alignment, external_tag=tag)
            outcomes.append(None)
        except (ValueError, TypeError) as e:
            outcomes.append((type(e).__name__ if type(e) is not ValueError else "ValueError", str(e)))
    return outcomes


def _normalise(output, to_bytes):
    def entries(d):
        return [(k, e.buffer_index, e.alignment, e.tensor_layout) for k, e in d.items()]

    return (
        [to_bytes(b) for b in output.buffers],
        entries(output.pte_data),
        [(tag, entries(d)) for tag, d in output.external_data.items()],
    )


def _source_bytes(source):
    return b"".join(bytes(p) for p in source.pieces(BufferRing(count=1)))


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=12))
def test_random_sequences_match_upstream(ops):
    upstream, ours = NamedDataStore(), StreamingNamedDataStore()
    assert _apply(ours, ops) == _apply(upstream, ops)
    assert _normalise(ours.get_named_data_store_output(), _source_bytes) == _normalise(
        upstream.get_named_data_store_output(), bytes
    )


@settings(max_examples=100, deadline=None)
@given(st.lists(op, max_size=8), st.lists(op, max_size=8))
def test_merge_matches_upstream(first, second):
    up_a, up_b = NamedDataStore(), NamedDataStore()
    _apply(up_a, first)
    _apply(up_b, second)
    ours = StreamingNamedDataStore()
    _apply(ours, first)
    upstream_error = ours_error = None
    try:
        up_a.merge_named_data_store(up_b.get_named_data_store_output())
    except ValueError as e:
        upstream_error = str(e)
    try:
        ours.merge_named_data_store(up_b.get_named_data_store_output())
    except ValueError as e:
        ours_error = str(e)
    assert ours_error == upstream_error
    assert _normalise(ours.get_named_data_store_output(), _source_bytes) == _normalise(
        up_a.get_named_data_store_output(), bytes
    )


def test_duplicate_key_with_other_data_raises_upstream_text_and_writes_nothing(tmp_path):
    store = StreamingNamedDataStore()
    store.add_named_data("w", b"1234", external_tag="weights")
    with pytest.raises(ValueError) as err:
        store.add_named_data("w", b"abcdefgh", external_tag="weights")
    assert str(err.value) == (
        "Duplicate key w with different data. Existing data size: 4 bytes. "
        "New data size: 8 bytes."
    )
    upstream = NamedDataStore()
    upstream.add_named_data("w", b"1234", external_tag="weights")
    with pytest.raises(ValueError) as up_err:
        upstream.add_named_data("w", b"abcdefgh", external_tag="weights")
    assert str(up_err.value) == str(err.value)
    assert os.listdir(tmp_path) == []


def test_existing_key_with_equal_data_ignores_new_alignment_and_tag():
    store = StreamingNamedDataStore()
    store.add_named_data("w", b"abcd", alignment=16)
    store.add_named_data("w", b"abcd", alignment=64, external_tag="t")
    out = store.get_named_data_store_output()
    assert out.pte_data["w"].alignment == 16 and out.external_data == {}


def test_tensor_sources_match_upstream_bytes_and_layout():
    torch.manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(4, 4).to(torch.bfloat16),
        "slice": torch.randn(6, 4)[2:4],
        "channels_last": torch.randn(1, 3, 4, 4).to(memory_format=torch.channels_last),
        "scalar": torch.tensor(3.5),
    }
    upstream, ours = NamedDataStore(), StreamingNamedDataStore()
    for key, t in tensors.items():
        upstream.add_named_data(key, t, external_tag="t")
        ours.add_named_data(key, t, external_tag="t")
    up, us = upstream.get_named_data_store_output(), ours.get_named_data_store_output()
    assert _normalise(us, _source_bytes) == _normalise(up, bytes)


def test_strided_tensor_view_is_refused_with_advice():
    from ptdstream import TensorSource
    from ptdstream.errors import LayoutError

    view = torch.randn(8, 8)[:, ::2]
    store, upstream = StreamingNamedDataStore(), NamedDataStore()
    with pytest.raises(ValueError) as ours_err:
        store.add_named_data("t", view)
    with pytest.raises(ValueError) as up_err:
        upstream.add_named_data("t", view)
    assert str(ours_err.value) == str(up_err.value)
    with pytest.raises(LayoutError, match=r"call \.contiguous\(\) on it"):
        TensorSource(view, "key 't'")


def test_file_backed_data_is_read_in_place(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(256)) * 100)
    upstream, ours = NamedDataStore(), StreamingNamedDataStore()
    for store in (upstream, ours):
        store.add_named_data("blob", FileBackedData(str(path)), external_tag="t")
        store.add_named_data("copy", bytes(range(256)) * 100, external_tag="t")
    assert _normalise(ours.get_named_data_store_output(), _source_bytes) == _normalise(
        upstream.get_named_data_store_output(), lambda b: b.to_bytes() if isinstance(b, FileBackedData) else b
    )
    assert ours.dedup_saved_nbytes == 25600


def test_write_data_files_matches_flat_tensor_serializer(tmp_path):
    from executorch.exir._serialize.data_serializer import DataPayload
    from executorch.extension.flat_tensor.serialize.serialize import (
        FlatTensorConfig,
        FlatTensorSerializer,
    )

    upstream, ours = NamedDataStore(), StreamingNamedDataStore()
    for store in (upstream, ours):
        store.add_named_data("a", b"x" * 100, alignment=48, external_tag="t")
        store.add_named_data("b", b"y" * 7, alignment=1, external_tag="t")
        store.add_named_data("c", b"x" * 100, alignment=16, external_tag="t")
    write_data_files(ours, str(tmp_path), segment_alignment=128)
    out = upstream.get_named_data_store_output()
    ref = FlatTensorSerializer(FlatTensorConfig(segment_alignment=128)).serialize(
        DataPayload(buffers=out.buffers, named_data=out.external_data["t"])
    )
    assert (tmp_path / "t.ptd").read_bytes() == bytes(ref)
    assert os.listdir(tmp_path) == ["t.ptd"]


def test_dimension_beyond_int32_is_refused_with_the_key(tmp_path):
    from executorch.exir.scalar_type import ScalarType
    from executorch.exir.tensor_layout import TensorLayout

    from ptdstream.errors import LayoutError

    store = StreamingNamedDataStore()
    layout = TensorLayout(ScalarType.BYTE, [1 << 31], [0])
    store.add_named_data("huge", b"x", external_tag="w", tensor_layout=layout)
    with pytest.raises(LayoutError, match=r"key 'huge': dimension 0 has size 2147483648"):
        write_data_files(store, str(tmp_path))
    assert os.listdir(tmp_path) == []
