"""The per-stage timeline of a save: off by default, and every byte accounted for when on."""

from __future__ import annotations

import os

import pytest

from ptdstream import StreamingNamedDataStore
from ptdstream.save import write_data_files
from ptdstream.timeline import record_stages, stage_timeline


@pytest.mark.parametrize("direct", [False, True])
def test_recorded_stages_account_for_every_byte_written(tmp_path, direct):
    payload = bytes(range(251)) * 40_000 + b"tail"  # ~10 MB, not a multiple of anything
    store = StreamingNamedDataStore()
    store.add_named_data("layer.weight", payload, external_tag="w")
    assert stage_timeline() is None
    with record_stages() as timeline:
        write_data_files(store, str(tmp_path), direct=direct)
    assert stage_timeline() is None
    stages = timeline.to_dict()["stages"]
    size = os.path.getsize(tmp_path / "w.ptd")
    assert stages["xxh3 digest"]["nbytes"] == len(payload)
    written = "staging copy" if "staging copy" in stages else "buffered write"
    assert stages[written]["nbytes"] == size  # header, padding and payload: every byte once
    if written == "staging copy":
        assert stages["O_DIRECT pwrite (I/O threads)"]["nbytes"] == size + (-size) % 4096
    assert stages["fsync + drop"]["calls"] == 1
    assert 0 < timeline.wall_seconds and all(s["seconds"] >= 0 for s in stages.values())


def test_nothing_is_recorded_outside_record_stages(tmp_path):
    store = StreamingNamedDataStore()
    store.add_named_data("k", b"x" * 1000, external_tag="w")
    with record_stages() as timeline:
        pass
    write_data_files(store, str(tmp_path))
    assert timeline.to_dict()["stages"] == {}
