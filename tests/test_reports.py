"""Reports and progress: Report.write_json streams the same text to_json returns
(plus a newline); every public writer takes ``progress`` as ``save`` does (True,
False, None or a callable; anything else refused before a byte is written);
``write_data_files`` returns a report like ``save``'s."""

from __future__ import annotations

import io
import os
import zlib

import pytest
import torch

from ptdstream import StreamingNamedDataStore
from ptdstream.check.inspection import inspect_files
from ptdstream.errors import ArgumentTypeError
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


def _store() -> StreamingNamedDataStore:
    store = StreamingNamedDataStore()
    store.add_named_data("a", bytes(range(256)) * 40, alignment=16, external_tag="w")
    store.add_named_data("b", torch.arange(300, dtype=torch.float32), external_tag="w")
    store.add_named_data("c", b"\x07" * 999, external_tag="x")
    return store


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """A two-linear program with external constants, its weights as safetensors, a
    packed .ptd: the inputs of every writer."""
    from _checkpoints import save_checkpoint, state_of
    from conftest import Mlp, export
    from executorch.exir import ExecutorchBackendConfig

    import ptdstream
    from ptdstream.pack.compress import pack

    root = tmp_path_factory.mktemp("progress")
    torch.manual_seed(0)
    model = Mlp()
    manager = export(model, config=ExecutorchBackendConfig(external_constants=True))
    (root / "prog").mkdir()
    ptdstream.save(manager, str(root / "prog" / "model.pte"))
    ckpt = save_checkpoint("safetensors", state_of(model), root / "ckpt")
    pack(str(root / "prog" / "_default_external_constant.ptd"), str(root / "w.ptd.zst"))
    return root, manager, ckpt


def _write(writer: str, program, out, progress):
    """Run ``writer`` into the existing folder ``out``; its report."""
    import ptdstream
    from ptdstream.pack.compress import pack
    from ptdstream.pack.decompress import unpack

    root, manager, ckpt = program
    if writer == "save":
        return ptdstream.save(manager, str(out / "model.pte"), progress=progress)
    if writer == "write_data_files":
        return ptdstream.write_data_files(_store(), str(out), progress=progress)
    if writer == "write_ptd":
        return ptdstream.write_ptd(str(root / "prog" / "model.pte"), ckpt, str(out), progress=progress)
    if writer == "pack":
        return pack(str(root / "prog" / "_default_external_constant.ptd"), str(out / "w.ptd.zst"), progress=progress)
    if writer == "unpack":
        return unpack(str(root / "w.ptd.zst"), str(out / "w.ptd"), progress=progress)
    import torch.distributed as dist

    from ptdstream.distributed import write_data_files

    # an in-memory store: a free port probed then bound could be taken by another process in between
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return write_data_files({"a": torch.arange(500, dtype=torch.float32), "b": torch.ones(7, 3)}, str(out),
                                external_tag="w", progress=progress)
    finally:
        dist.destroy_process_group()


WRITERS = ["save", "write_data_files", "write_ptd", "pack", "unpack", "distributed.write_data_files"]


def _files(folder) -> dict[str, int]:
    return {p.name: zlib.crc32(p.read_bytes()) for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("writer", WRITERS)
def test_every_writer_takes_progress_as_save_does(tmp_path, program, writer, capsys):
    """True draws a bar on stderr, a callable gets the bytes of each piece (all of
    them, in all), False and None draw nothing; the files are the same each way."""
    outputs = {}
    for name, progress in [("false", False), ("none", None), ("true", True), ("callable", [].append)]:
        out = tmp_path / name
        out.mkdir()
        capsys.readouterr()
        _write(writer, program, out, progress)
        err = capsys.readouterr().err
        outputs[name] = _files(out)
        if name == "true":
            assert "B/s" in err or "100%" in err, err  # tqdm's bar
        else:
            assert err == ""
        if name == "callable":
            pieces = progress.__self__
            assert pieces and all(isinstance(n, int) and n >= 0 for n in pieces)
            written = {"pack": (program[0] / "prog" / "_default_external_constant.ptd").stat().st_size,
                       "distributed.write_data_files": 500 * 4 + 7 * 3 * 4}.get(writer)
            if written is None:  # every byte of every file it published
                written = sum(size for size in (p.stat().st_size for p in out.iterdir()))
            assert sum(pieces) == written
    assert outputs["false"] == outputs["none"] == outputs["true"] == outputs["callable"]
    assert outputs["false"]


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("progress", [1, "yes", object()])
def test_a_progress_outside_the_contract_is_refused_before_anything_is_written(tmp_path, program, writer,
                                                                                progress):
    from ptdstream.distributed import DistributedWriteError

    (tmp_path / "keep.bin").write_bytes(b"old")
    expected = DistributedWriteError if writer.startswith("distributed") else ArgumentTypeError
    with pytest.raises(expected) as info:
        _write(writer, program, tmp_path, progress)
    message = str(info.value)
    assert f"progress={progress!r} ({type(progress).__name__})" in message
    assert "a callable taking the bytes of each piece" in message
    if writer.startswith("distributed"):
        assert "describe the pieces" in message and "rank 0" in message
    else:
        assert isinstance(info.value, TypeError)
    assert _files(tmp_path) == {"keep.bin": zlib.crc32(b"old")}


def test_write_data_files_returns_a_report_like_save(tmp_path):
    import json

    from ptdstream import DataFilesReport, write_data_files

    report = write_data_files(_store(), str(tmp_path))
    assert isinstance(report, DataFilesReport)
    sizes = {"w.ptd": (tmp_path / "w.ptd").stat().st_size, "x.ptd": (tmp_path / "x.ptd").stat().st_size}
    assert [os.path.basename(f.path) for f in report.files] == ["w.ptd", "x.ptd"]
    assert report.nbytes == sum(sizes.values())
    lines = report.summary().splitlines()
    assert lines[:2] == [f"{tmp_path / name}  {size:,} bytes" for name, size in sizes.items()]
    assert lines[2].startswith(f"{report.nbytes:,} bytes in ") and lines[2].endswith("dedup saved 0 bytes")
    data = json.loads(report.to_json())
    assert [f["nbytes"] for f in data["files"]] == list(sizes.values())
    assert data["manifest_path"] is None and data["options"]["segment_alignment"] == 128
    assert len(report) == 2 and list(report) == list(report.files) and report[1] is report.files[1]


def test_the_distributed_report_has_a_summary(tmp_path, program):
    report = _write("distributed.write_data_files", program, tmp_path, False)
    size = (tmp_path / "w.ptd").stat().st_size
    assert report.summary().splitlines()[0] == f"{tmp_path / 'w.ptd'}  {size:,} bytes"
    assert report.summary().splitlines()[1].startswith(f"{500 * 4 + 7 * 3 * 4:,} bytes written by this rank; the "
                                                       "call took ")
    assert '"rank_nbytes": 2084' in report.to_json()


def test_a_rate_is_printed_only_where_it_means_throughput():
    from ptdstream.reports import RATE_MIN_NBYTES, rate

    assert RATE_MIN_NBYTES == 64 << 20
    assert rate(RATE_MIN_NBYTES - 1, 0.01) == ""  # a small write: fsync and rename latency, not throughput
    assert rate(RATE_MIN_NBYTES, 0.0) == ""
    assert rate(RATE_MIN_NBYTES, 0.5) == "0.13 GB/s"
    assert rate(RATE_MIN_NBYTES, 0.5, "MB/s") == "134 MB/s"


def test_small_writes_print_no_rate_and_say_what_the_seconds_are(tmp_path, monkeypatch):
    import re

    import ptdstream.reports

    report = write_data_files(_store(), str(tmp_path))
    line = report.summary().splitlines()[2]
    assert re.fullmatch(rf"{report.nbytes:,} bytes in \d+\.\d\d s \(planning \d+\.\d\d s, then the write, fsync and "
                        r"publish\); dedup saved 0 bytes", line), line
    monkeypatch.setattr(ptdstream.reports, "RATE_MIN_NBYTES", 1)  # as a write of 64 MiB or more prints it
    assert re.search(r"then the write, fsync and publish: \d+\.\d\d GB/s\); dedup", report.summary())


def test_write_ptd_times_the_write_itself(tmp_path, monkeypatch):
    """``write_seconds`` is the write (temp files, fsync, publish), the span of ``gbps``;
    what comes before it (opening and checking the checkpoint, planning, on a first
    call the imports) is the rest of ``seconds``. Before, the API's one figure was the
    whole call: "41,728 bytes in 47.48 s (0.00 GB/s)" where the CLI said 0.42 s."""
    import re
    import time

    from _small_exports import model, write_reference
    from safetensors.torch import save_file

    import ptdstream.weights.write as weights_write

    files = write_reference("external", tmp_path / "ref")
    save_file({k: v.detach().contiguous() for k, v in model("external").state_dict().items()},
              str(tmp_path / "ck.safetensors"))
    real_plan = weights_write.plan_ptd_files

    def slow_plan(*args, **kwargs):  # the steps before the write take at least 0.5 s here
        time.sleep(0.5)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(weights_write, "plan_ptd_files", slow_plan)
    (tmp_path / "out").mkdir()
    report = weights_write.write_ptd(files["model.pte"], str(tmp_path / "ck.safetensors"), str(tmp_path / "out"))
    assert 0 < report.write_seconds and report.seconds - report.write_seconds >= 0.5
    assert report.gbps == report.nbytes / report.write_seconds / 1e9
    line = report.summary().splitlines()[-1]
    assert re.fullmatch(rf"4 keys, {report.nbytes:,} bytes written in \d+\.\d\d s \(the write, fsync and publish; "
                        r"checking and planning before it \d+\.\d\d s\); dedup saved 0 bytes", line), line
    assert float(line.split("before it ")[1].split(" s)")[0]) >= 0.5
