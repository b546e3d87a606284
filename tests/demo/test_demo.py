"""``ptdstream demo`` end to end: real export, real save, real runtime.

The XNNPACK lowering (~15 s on two cores) runs once per module: ``build_demo`` is
called for real by the ``built`` fixture, and the runs through ``main`` reuse it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import os
import subprocess
import sys
import time

import pytest
from _procs import SAFETY_S

from ptdstream.demo import run as demo

pytestmark = pytest.mark.slow

EMBEDDING_NBYTES = 512 * 64 * 4


_BUILD_LOG = io.StringIO()


@pytest.fixture(scope="module")
def built():
    return demo.build_demo(stages=demo.Stages(_BUILD_LOG, 5))


def test_build_announces_export_and_lowering_with_times(built):
    lines = _BUILD_LOG.getvalue().splitlines()
    assert [line.split(" ...")[0] for line in lines[::2]] == [
        "[1/5] export 2 methods with torch.export",
        "[2/5] lower to XNNPACK and emit (to_edge_transform_and_lower, to_executorch)"]
    assert all(": done in " in line and line.endswith(" s") for line in lines[1::2])


@pytest.fixture
def cached_build(built, monkeypatch):
    monkeypatch.setattr(demo, "build_demo", lambda seed=0, stages=None: built)
    return built


def _ns(out, no_run):
    return argparse.Namespace(out=str(out), no_run=no_run)


def test_main_with_runtime_is_identical_matches_eager_and_exits_0(cached_build, tmp_path, capsys):
    out = tmp_path / "demo"
    assert demo.main(_ns(out, no_run=False)) == 0
    captured = capsys.readouterr()
    printed = captured.out
    stages = [line.split("] ", 1)[1].split(":")[0] for line in captured.err.splitlines() if ": done in " in line]
    assert stages == [f"save with ptdstream into {out}",  # export and lowering are cached here
                      "verify byte identity against executorch's serializer (streamed from the manager)",
                      "run both methods with the ExecuTorch runtime and compare with eager PyTorch"]
    assert sorted(os.listdir(out)) == ["model.ptd", "model.pte"]
    for name in ("model.pte", "model.ptd"):
        assert f"OK {out / name}: identical to executorch's serializer of the same manager ({name}, " in printed
    assert "forward max|diff|" in printed and "prefill max|diff|" in printed
    assert "MISMATCH" not in printed
    assert printed.rstrip().endswith("result: OK")


def test_main_no_run_skips_runtime_and_exits_0(cached_build, tmp_path, capsys):
    assert demo.main(_ns(tmp_path, no_run=True)) == 0
    printed = capsys.readouterr().out
    assert "runtime check: skipped (--no-run)" in printed
    assert "max|diff|" not in printed
    assert sorted(os.listdir(tmp_path)) == ["model.ptd", "model.pte"]


def test_run_demo_files_equal_upstream_writers_and_tied_embedding_stored_once(
    cached_build, tmp_path
):
    out, ref = tmp_path / "out", tmp_path / "ref"
    result = demo.run_demo(str(out), no_run=False, progress=False)

    # Identity as the demo reports it, and against upstream's own writers.
    assert result.identical and result.exit_code == 0
    assert [os.path.basename(f.out_path) for f in result.files] == ["model.pte", "model.ptd"]
    assert all(f.out_nbytes == f.ref_nbytes for f in result.files)
    manager = cached_build.manager
    ref.mkdir()
    with open(ref / "model.pte", "wb") as f:
        manager.write_to_file(f)
    manager.write_tensor_data_to_file(str(ref))
    assert sorted(os.listdir(ref)) == ["model.ptd", "model.pte"]
    for name in ("model.pte", "model.ptd"):
        assert (out / name).read_bytes() == (ref / name).read_bytes()
    for f in result.report.files:
        assert os.path.getsize(f.path) == f.nbytes
    assert result.report.nbytes == sum(os.path.getsize(out / n) for n in ("model.pte", "model.ptd"))

    # The tied 512x64 fp32 table: an FQN key (emitter) and its SHA-256 key
    # (XNNPACK) name one segment, and no other segment holds those bytes.
    from executorch.exir._serialize._cord import Cord
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    weight = cached_build.model.tok_embeddings.weight.detach().numpy().tobytes()
    sha = hashlib.sha256(weight).hexdigest()
    payload = FlatTensorSerializer().deserialize(Cord((out / "model.ptd").read_bytes()))
    index = payload.named_data[sha].buffer_index
    sharing = sorted(k for k, e in payload.named_data.items() if e.buffer_index == index)
    assert len(sharing) == 2 and sha in sharing
    assert [k for k in sharing if k != sha][0].endswith(".weight")
    assert [bytes(b) for b in payload.buffers].count(weight) == 1
    assert result.tied == demo.TiedEmbedding(tuple(result.tied.keys), index, EMBEDDING_NBYTES, 1)
    assert sorted(result.tied.keys) == sharing
    assert result.report.dedup_saved_nbytes >= EMBEDDING_NBYTES

    # Runtime outputs are close to eager, for both methods.
    rt = result.runtime
    assert set(rt.max_abs_diff) == {"forward", "prefill"}
    assert all(0 <= d < demo.ATOL for d in rt.max_abs_diff.values())
    assert rt.ok and rt.xnnpack_available
    assert result.rss_added_nbytes >= 0


def test_reference_writes_upstreams_own_files_beside_the_output(cached_build, tmp_path, capsys):
    out, ref, upstream = tmp_path / "out", tmp_path / "ref", tmp_path / "upstream"
    (ref).mkdir()
    (ref / "model.pte").write_bytes(b"an older reference")
    args = argparse.Namespace(out=str(out), no_run=True, reference=str(ref))
    assert demo.main(args) == 0
    captured = capsys.readouterr()
    assert f"reference (executorch's own serializer): {ref / 'model.pte'}, {ref / 'model.ptd'}" in captured.out
    assert f"write executorch's own files into {ref} (reference): done in " in captured.err
    upstream.mkdir()
    with open(upstream / "model.pte", "wb") as f:
        cached_build.manager.write_to_file(f)
    cached_build.manager.write_tensor_data_to_file(str(upstream))
    assert sorted(os.listdir(ref)) == ["model.ptd", "model.pte"]  # replaced; no temp folder left
    for name in ("model.pte", "model.ptd"):
        assert (ref / name).read_bytes() == (upstream / name).read_bytes() == (out / name).read_bytes()


def test_reference_that_is_the_output_folder_is_refused_before_the_export(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(demo, "build_demo", lambda **k: pytest.fail("exported before the folders were checked"))
    args = argparse.Namespace(out=str(tmp_path / "out"), no_run=True, reference=str(tmp_path / "out" / "."))
    assert demo.main(args) == 2
    assert capsys.readouterr().err == (f"ptdstream demo: --reference {tmp_path / 'out' / '.'} is the output folder; "
                                       "give another folder (executorch's files would replace ptdstream's)\n")
    assert os.listdir(tmp_path) == []


def test_changed_byte_is_reported_with_its_offset_and_fails_the_demo(cached_build, tmp_path):
    result = demo.run_demo(str(tmp_path), no_run=True, progress=False)
    ptd = tmp_path / "model.ptd"
    data = bytearray(ptd.read_bytes())
    data[1000] ^= 0xFF
    ptd.write_bytes(bytes(data))
    from ptdstream.check.compare import verify_against_manager

    pte_report, ptd_report = verify_against_manager(cached_build.manager, str(tmp_path / "model.pte"))
    assert pte_report.ok and not ptd_report.ok
    assert ptd_report.first_diff_offset == 1000
    failed = dataclasses.replace(result, files=(pte_report, ptd_report))
    assert failed.exit_code == 1
    summary = demo.format_summary(failed)
    assert "MISMATCH" in summary and "result: FAILED" in summary
    assert sorted(os.listdir(tmp_path)) == ["model.ptd", "model.pte"]


def test_exit_code_is_1_on_byte_mismatch_or_runtime_mismatch(cached_build, tmp_path):
    result = demo.run_demo(str(tmp_path), no_run=True, progress=False)
    assert result.exit_code == 0 and result.runtime is None
    bad_file = dataclasses.replace(result.files[0], first_diff_offset=7)
    assert dataclasses.replace(result, files=(bad_file,) + result.files[1:]).exit_code == 1
    assert dataclasses.replace(result, files=()).exit_code == 1
    bad_rt = demo.RuntimeCheck({"forward": 1.0}, {"forward": False}, True)
    assert dataclasses.replace(result, runtime=bad_rt).exit_code == 1
    assert "result: FAILED" in demo.format_summary(dataclasses.replace(result, runtime=bad_rt))


def test_peak_rss_sampler_sees_a_64_mib_allocation():
    with demo.PeakRssSampler() as rss:
        block = bytearray(64 << 20)
        block[:: 4096] = b"x" * len(block[:: 4096])  # touch every page
        # held until the sampler has read it twice (a read may have begun before the
        # touch): a fixed sleep missed it when the sampler thread got no CPU meanwhile
        seen, deadline = rss.samples, time.monotonic() + 60
        while rss.samples < seen + 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        del block
    assert rss.added_nbytes >= 60 << 20
    assert rss.samples >= 1


def test_add_arguments_defaults_and_module_help():
    from ptdstream.demo import add_arguments

    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args([])
    assert (args.out, args.no_run, args.reference) == ("./ptdstream-demo", False, None)
    assert parser.parse_args(["--reference", "ref"]).reference == "ref"
    assert parser.parse_args(["--out", "x", "--no-run"]).no_run is True
    proc = subprocess.run(
        [sys.executable, "-m", "ptdstream.demo", "--help"], capture_output=True, text=True, timeout=SAFETY_S
    )
    assert proc.returncode == 0 and "--no-run" in proc.stdout and "--reference DIR" in proc.stdout
