"""SourceBackedData: upstream accepts ptdstream sources; both paths give the same bytes."""

from __future__ import annotations

import os

import torch
from executorch.exir._serialize._named_data_store import NamedDataStore
from executorch.exir._serialize.data_serializer import DataPayload
from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

from ptdstream import FileRangeSource, StreamingNamedDataStore
from ptdstream.hooks.interop import SourceBackedData
from ptdstream.save import write_data_files


class CountingSource(FileRangeSource):
    reads = 0

    def pieces(self, ring):
        type(self).reads += 1
        return super().pieces(ring)


def test_upstream_slow_path_and_ptdstream_fast_path_agree(tmp_path):
    torch.manual_seed(0)
    engine = tmp_path / "engine.bin"
    engine.write_bytes(os.urandom(3 << 20))
    weight = torch.randn(300, 7).to(torch.bfloat16)
    items = {
        "engine": SourceBackedData(CountingSource(str(engine))),
        "weight": SourceBackedData(weight),
        "weight_again": SourceBackedData(weight.clone()),
    }
    upstream = NamedDataStore()
    for key, data in items.items():
        upstream.add_named_data(key, data, alignment=64, external_tag="engines")
    out = upstream.get_named_data_store_output()
    assert len(out.buffers) == 2, "upstream dedups our data by its SHA-256 too"
    reference = FlatTensorSerializer().serialize(
        DataPayload(buffers=out.buffers, named_data=out.external_data["engines"])
    )
    reference_bytes = bytes(reference)

    CountingSource.reads = 0
    ours = StreamingNamedDataStore()
    ours.merge_named_data_store(out)
    folder = tmp_path / "out"
    folder.mkdir()
    write_data_files(ours, str(folder))
    assert (folder / "engines.ptd").read_bytes() == reference_bytes
    assert CountingSource.reads == 1, "the fast path reads the engine file once"
    assert os.listdir(folder) == ["engines.ptd"]
