"""Report.write_json streams the same text to_json returns (plus a newline)."""

from __future__ import annotations

import io

from ptdstream import StreamingNamedDataStore
from ptdstream.check.inspection import inspect_files
from ptdstream.save import write_data_files


def test_write_json_streams_to_jsons_text(tmp_path):
    store = StreamingNamedDataStore()
    for i in range(3000):  # JSON larger than the 64 KiB flush size
        store.add_named_data(f"layers.{i}.weight", i.to_bytes(4, "little") * 4, external_tag="w")
    write_data_files(store, str(tmp_path))
    report = inspect_files([str(tmp_path / "w.ptd")])
    out = io.StringIO()
    report.write_json(out)
    assert len(out.getvalue()) > 1 << 17
    assert out.getvalue() == report.to_json() + "\n"
