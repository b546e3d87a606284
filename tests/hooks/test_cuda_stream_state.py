"""The state of a ``stream_cuda_weights`` context (``CudaWeightStream``): its phases,
its refusals and upstream's path for CPU storages. Runs without a GPU."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

from ptdstream.errors import StateError
from ptdstream.hooks.cuda.backend import stream_cuda_weights
from ptdstream.hooks.cuda.keeping import CudaWeightStats
from ptdstream.hooks.cuda.routing import CudaWeightStream, StreamState
from ptdstream.upstream import adapter


@pytest.fixture
def collector():
    return adapter.cuda_weight_collector()


def _originals(collector):
    return (collector._write_tensor_storage, collector.FileBackedData,
            collector.CudaWeightCollector.materialize, collector.trim_host_memory)


def _materialize(collector, weights, folder):
    artifact = collector.CudaWeightCollector().materialize(
        {fqn: (t, None) for fqn, t in weights.items()}, str(folder), lambda t: 0)
    return {e.fqn: artifact.storages[e.storage_key] for e in artifact.entries}


def test_open_routes_close_restores_and_close_is_idempotent(collector):
    before = _originals(collector)
    stream = CudaWeightStream()
    assert stream.state is StreamState.READY and _originals(collector) == before
    stats = stream.open()
    assert stream.state is StreamState.ROUTING and stats is stream.stats and stats == CudaWeightStats()
    assert collector._write_tensor_storage == stream.write_storage
    assert issubclass(collector.FileBackedData, before[1]) and collector.FileBackedData is not before[1]
    assert collector.CudaWeightCollector.materialize is not before[2]
    assert collector.trim_host_memory is not before[3]
    stream.close()
    assert stream.state is StreamState.CLOSED and _originals(collector) == before
    stream.close()
    assert stream.state is StreamState.CLOSED and _originals(collector) == before


def test_trim_host_memory_keeps_upstreams_trim(collector):
    trim = collector.trim_host_memory
    with CudaWeightStream(trim_host_memory=True):
        assert collector.trim_host_memory is trim
    assert collector.trim_host_memory is trim


@pytest.mark.parametrize("closed", [False, True])
def test_open_twice_is_refused_naming_both_states(collector, closed):
    stream = CudaWeightStream()
    stream.open()
    if closed:
        stream.close()
    actual = "closed" if closed else "routing"
    with pytest.raises(StateError, match=f"stream_cuda_weights: open expects state ready, but it is {actual}$"):
        stream.open()
    stream.close()
    assert not collector.FileBackedData.__name__.startswith("_")


@pytest.mark.parametrize("phase", ["ready", "closed"])
def test_the_collectors_calls_are_refused_outside_routing(tmp_path, phase):
    stream = CudaWeightStream()
    if phase == "closed":
        stream.open()
        stream.close()
    t = torch.arange(4, dtype=torch.int32)
    calls = {
        "write_storage": lambda: stream.write_storage(t, str(tmp_path / "w")),
        "move_from": lambda: stream.move_from(str(tmp_path / "w"), None),
        "materialize": lambda: stream.materialize(object(), {}),
    }
    for name, call in calls.items():
        with pytest.raises(StateError, match=f"{name} expects state routing, but it is {phase}$"):
            call()
    assert os.listdir(tmp_path) == []
    assert stream.stats == CudaWeightStats()


def test_a_second_stream_is_refused_while_one_routes_and_stays_ready(collector):
    before = _originals(collector)
    with stream_cuda_weights(twins=False):
        routed = _originals(collector)
        second = CudaWeightStream()
        with pytest.raises(RuntimeError, match="already active in this process: lower one model at a time"):
            second.open()
        assert second.state is StreamState.READY and _originals(collector) == routed
    assert _originals(collector) == before


def test_an_unusable_spill_folder_is_refused_at_open_and_nothing_is_patched(collector, tmp_path):
    before = _originals(collector)
    stream = CudaWeightStream(spill_dir=str(tmp_path / "missing"))
    with pytest.raises(OSError) as e:
        stream.open()
    assert f"spill folder {tmp_path / 'missing'}: cannot create a spill file there" in str(e.value)
    assert stream.state is StreamState.READY and _originals(collector) == before
    assert os.listdir(tmp_path) == []


def test_an_error_inside_the_context_closes_it(collector):
    before = _originals(collector)
    with pytest.raises(KeyError):
        with stream_cuda_weights():
            assert _originals(collector) != before
            raise KeyError("lowering failed")
    assert _originals(collector) == before
    stream = CudaWeightStream()
    with pytest.raises(KeyError):
        with stream:
            raise KeyError("lowering failed")
    assert stream.state is StreamState.CLOSED and _originals(collector) == before


def test_cpu_storages_take_upstreams_path_with_upstreams_bytes_and_keys(collector, tmp_path):
    weights = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    plain = _materialize(collector, weights, tmp_path)
    with stream_cuda_weights() as stats:
        routed = _materialize(collector, weights, tmp_path)
    assert stats == CudaWeightStats(upstream=2)
    for fqn, t in weights.items():
        want = t.contiguous().view(torch.uint8).numpy().tobytes()
        assert type(routed[fqn]) is type(plain[fqn])  # upstream's own FileBackedData
        assert routed[fqn].to_bytes() == plain[fqn].to_bytes() == want
        assert adapter.cached_sha256(routed[fqn]) == hashlib.sha256(want).digest()
    for data in list(plain.values()) + list(routed.values()):
        data.close()
    assert os.listdir(tmp_path) == []


def test_move_from_of_a_path_not_written_here_is_upstreams(collector, tmp_path):
    path = tmp_path / "upstream.storage"
    path.write_bytes(b"written by upstream")
    with CudaWeightStream() as stats:
        data = collector.FileBackedData.move_from(str(path), sha256=b"\x01" * 32)
    assert type(data) is adapter.file_backed_data_type()
    assert data.to_bytes() == b"written by upstream" and adapter.cached_sha256(data) == b"\x01" * 32
    assert stats == CudaWeightStats()
    data.close()


@pytest.fixture
def trims(monkeypatch, collector):
    """Counts of upstream's ``trim_host_memory`` and of ptdstream's ``malloc_trim`` calls."""
    from ptdstream.hooks.cuda import routing

    calls = {"upstream": 0, "malloc_trim": 0}

    def upstream_trim():
        calls["upstream"] += 1

    def ours():
        calls["malloc_trim"] += 1
        return True

    monkeypatch.setattr(collector, "trim_host_memory", upstream_trim)
    monkeypatch.setattr(routing, "malloc_trim", ours)
    return calls


@pytest.mark.parametrize("mode,want", [
    ("malloc_trim", {"upstream": 0, "malloc_trim": 2}),  # the default: once after each collect
    (True, {"upstream": 4, "malloc_trim": 0}),  # upstream's own, before and after each
    (False, {"upstream": 0, "malloc_trim": 0}),
])
def test_trim_host_memory_modes_per_collect(collector, trims, tmp_path, mode, want):
    weights = {"w": torch.arange(64, dtype=torch.float32)}
    with stream_cuda_weights(trim_host_memory=mode) as stats:
        for _ in range(2):
            got = _materialize(collector, weights, tmp_path)
            assert got["w"].to_bytes() == weights["w"].numpy().tobytes()
    assert trims == want and stats.upstream == 2


def test_the_default_trim_mode_is_malloc_trim_after_each_collect(collector, trims, tmp_path):
    with stream_cuda_weights():
        _materialize(collector, {"w": torch.arange(8, dtype=torch.int32)}, tmp_path)
    assert trims == {"upstream": 0, "malloc_trim": 1}


@pytest.mark.parametrize("mode", ["gc", 1, None])
def test_an_unknown_trim_mode_is_refused_before_anything_is_patched(collector, mode):
    from ptdstream.errors import ArgumentTypeError

    before = _originals(collector)
    with pytest.raises(ArgumentTypeError, match=rf"trim_host_memory={mode!r} \(a {type(mode).__name__}\) "
                                                r"is not one of 'malloc_trim', True, False"):
        with stream_cuda_weights(trim_host_memory=mode):
            pass
    assert _originals(collector) == before


class _Mode(str):
    pass


@pytest.mark.parametrize(("mode", "kind"), [
    (np.array("malloc_trim"), "numpy.ndarray"),  # == "malloc_trim" is a true 0-d array
    (np.array(["malloc_trim", "x"]), "numpy.ndarray"),  # == raises numpy's ValueError
    (np.bool_(True), "numpy.bool"),
    (_Mode("malloc_trim"), f"{__name__}._Mode"),
    (1, "int"),
    (0.0, "float"),
])
def test_only_the_str_malloc_trim_and_bools_are_trim_modes(mode, kind):
    from ptdstream.errors import ArgumentTypeError
    from ptdstream.hooks.cuda.trim import check_mode

    with pytest.raises(ArgumentTypeError) as caught:
        check_mode(mode)
    message = str(caught.value)
    assert f"(a {kind}) is not one of 'malloc_trim', True, False" in message
    assert message.startswith(f"stream_cuda_weights: trim_host_memory={mode!r}"[:60])
    assert check_mode("malloc_trim") == "malloc_trim" and check_mode(True) is True and check_mode(False) is False


def test_malloc_trim_runs_glibcs():
    import sys

    from ptdstream.hooks.cuda.trim import malloc_trim

    assert malloc_trim() is sys.platform.startswith("linux")
