"""Bound weights loaded straight from the checkpoint file to the device (weightless/to_device.py),
on the CPU: a host "device" staging, and a stand-in for executorch's CudaBackend."""

from __future__ import annotations

import copy
import os

import pytest
import safetensors.torch as st
import torch
from conftest import Mlp, mapped_rss

from ptdstream.defaults import CHUNK_NBYTES
from ptdstream.errors import IntegrityError
from ptdstream.hooks.cuda import sharing
from ptdstream.sources.base import FileIdentity
from ptdstream.sources.checkpoint import open_checkpoint
from ptdstream.upstream import adapter
from ptdstream.weightless import to_device, weights_from
from ptdstream.weightless.convert import ConvertDir
from ptdstream.weightless.device_load import DeviceLoad, HostStaging, load_to_device
from ptdstream.weightless.to_device import DeviceLoads

CHUNK = 4096


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _open(path):
    ck = open_checkpoint(str(path))
    return ck, DeviceLoads(ck, {f: FileIdentity.of(os.stat(f)) for f in ck.files()})


def test_loads_exact_bytes_around_the_piece_size_without_touching_the_mapping(tmp_path):
    torch.manual_seed(0)
    sizes = {"a": CHUNK // 4 - 1, "b": CHUNK // 4, "c": CHUNK // 4 + 1, "d": 3 * CHUNK // 4 + 5, "big": 1 << 21}
    state = {k: torch.randn(n) for k, n in sizes.items()}
    state["perm"] = torch.randn(48, 40).t()  # dense, not contiguous: .to keeps its strides
    path = tmp_path / "w.safetensors"
    st.save_file({k: v.contiguous() for k, v in state.items()}, path)
    ck, loads = _open(path)
    with ck:
        for key in state:
            view = ck.tensor(key)
            rss = mapped_rss(path)
            load = loads.plan(key, view)
            assert load.path == str(path) and load.stored == torch.float32 and load.source is None
            out = load_to_device(load, HostStaging(CHUNK))
            assert mapped_rss(path) - rss < (256 << 10), key  # the mapping's pages never faulted in
            assert (out.dtype, out.shape, out.stride(), out.storage_offset()) == (
                view.dtype, view.shape, view.stride(), 0)
            assert out.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
            assert _bytes(out) == _bytes(view.clone()), key


@pytest.mark.parametrize("stored, wanted", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                             (torch.float32, torch.float16)])
def test_a_converted_key_gives_the_binding_copys_bytes(tmp_path, stored, wanted):
    torch.manual_seed(1)
    values = torch.randn(3 * CHUNK + 7) * 1e3
    values[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 65520.0])
    path = tmp_path / "w.safetensors"
    st.save_file({"w": values.to(stored)}, path)
    ck, loads = _open(path)
    with ck:
        convert = ConvertDir()
        entry = ck.entries["w"]
        bound = convert.convert(ck.source("w"), stored, wanted, entry.shape, entry.dim_order, "w")
        loads.add("w", bound)
        load = loads.plan("w", bound)
        assert load.path == str(path) and (load.stored, load.dtype) == (stored, wanted)
        out = load_to_device(load, HostStaging(CHUNK))
        assert out.dtype == wanted and _bytes(out) == _bytes(bound) == _bytes(ck.tensor("w").to(wanted))
        convert.close()


def test_a_checkpoint_changed_since_it_was_opened_is_refused_naming_file_and_key(tmp_path):
    path = tmp_path / "w.safetensors"
    st.save_file({"w": torch.ones(2048)}, path)
    ck, loads = _open(path)
    with ck:
        load = loads.plan("w", ck.tensor("w"))
        data = bytearray(path.read_bytes())
        data[-4:] = b"\0\0\0\0"
        with open(path, "r+b") as f:  # in place: same inode and size, new bytes
            f.write(data)
        os.utime(path, ns=(1, 1))
        with pytest.raises(IntegrityError) as e:
            load_to_device(load, HostStaging(CHUNK))
    msg = str(e.value)
    assert f"{path}: key 'w'" in msg and f"checkpoint file {path} changed after weights_from opened it" in msg
    assert "before it was read" in msg and "nothing loaded" in msg


def test_a_short_read_names_file_key_and_offset(tmp_path):
    path = tmp_path / "w.safetensors"
    st.save_file({"w": torch.ones(4096)}, path)
    ck, loads = _open(path)
    with ck:
        load = loads.plan("w", ck.tensor("w"))
    size = os.path.getsize(path)
    os.truncate(path, size - 100)
    now = FileIdentity.of(os.stat(path))
    short = DeviceLoad(load.label, load.shape, load.stride, load.dtype, path=load.path, offset=load.offset,
                       stored=load.stored, identity=now)  # the identity check passes: the read comes short
    with pytest.raises(IntegrityError) as e:
        load_to_device(short, HostStaging(CHUNK))
    msg = str(e.value)
    assert f"{path}: key 'w'" in msg and f"ended at offset {size - 100}" in msg
    assert f"needs 16384 bytes from offset {load.offset}" in msg
    # truncated after the context opened it: refused as changed, before anything is read
    with pytest.raises(IntegrityError, match="changed after weights_from opened it"):
        load_to_device(load, HostStaging(CHUNK))


class _Backend:
    """What the route relies on of ``CudaBackend``: upstream's default-mode copy (a
    deepcopy), a move that records the tensors it is handed (``.to("cuda")`` keeps a
    tensor already on the device), and a release that frees what it is handed."""

    moved: list = []
    released: list = []

    @classmethod
    def copy_exported_program_for_preprocess(cls, edge_program, compile_specs):
        return copy.deepcopy(edge_program)

    @classmethod
    def move_program_to_device(cls, edge_program, device, compile_specs):
        cls.moved.append(dict(edge_program.state_dict))
        return edge_program

    @classmethod
    def release_moved_tensors(cls, device_edge_program, compile_specs):
        for tensor in device_edge_program.state_dict.values():
            cls.released.append(tensor)
            tensor.untyped_storage().resize_(0)


_NAMES = ("copy_exported_program_for_preprocess", "move_program_to_device", "release_moved_tensors")


def _checkpoint(tmp_path):
    torch.manual_seed(0)
    model = Mlp().eval()
    path = tmp_path / "mlp.safetensors"
    st.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return model, path


def test_the_patch_is_active_only_inside_weights_from_and_restored_after(tmp_path, monkeypatch):
    _, path = _checkpoint(tmp_path)
    monkeypatch.setattr(adapter, "cuda_backend", lambda: _Backend)
    originals = {n: vars(_Backend)[n] for n in _NAMES}
    with weights_from(path):
        assert all(vars(_Backend)[n] is not originals[n] for n in _NAMES)
    assert {n: vars(_Backend)[n] for n in _NAMES} == originals
    with pytest.raises(KeyError), weights_from(path):
        raise KeyError("inside")
    assert {n: vars(_Backend)[n] for n in _NAMES} == originals and sharing.shared_count() == 0


def test_methods_share_one_device_copy_read_from_the_checkpoint(tmp_path, monkeypatch):
    model, path = _checkpoint(tmp_path)
    monkeypatch.setattr(adapter, "cuda_backend", lambda: _Backend)
    monkeypatch.setattr(DeviceLoads, "staging_for", lambda self, device: HostStaging(CHUNK))
    _Backend.moved, _Backend.released = [], []
    originals = {n: vars(_Backend)[n] for n in _NAMES}
    specs: list = []
    with weights_from(path) as weights:
        ep = weights.export(weights.model(Mlp), (torch.randn(2, 64),))
        mapped = {k: v.untyped_storage().data_ptr() for k, v in ep.state_dict.items()}
        for _ in range(3):  # three methods: copy, move, release, as AotiBackend.preprocess does
            c = _Backend.copy_exported_program_for_preprocess(ep, specs)
            assert all(c.state_dict[k] is v for k, v in ep.state_dict.items())  # shared, not deep-copied
            _Backend.move_program_to_device(c, "cuda", specs)
            _Backend.release_moved_tensors(c, specs)
        first, *later = _Backend.moved
        for k, v in model.state_dict().items():
            got = first[k]
            assert got.untyped_storage().data_ptr() != mapped[k]  # a new tensor, not the mapping
            assert isinstance(got, torch.nn.Parameter) and torch.equal(got.detach(), v), k
            assert all(m[k].untyped_storage().data_ptr() == got.untyped_storage().data_ptr() for m in later)
            assert got.untyped_storage().nbytes() == v.numel() * 4  # never released while lowering
        assert _Backend.released == []
        stats = weights.device_loads.stats
        n = len(model.state_dict())
        assert (stats.loaded, stats.reused, stats.converted, stats.left_to_upstream) == (n, 2 * n, 0, [])
        assert stats.loaded_nbytes == stats.read_nbytes == sum(v.numel() * 4 for v in model.state_dict().values())
        assert sharing.shared_count() > 0
    assert sharing.shared_count() == 0
    assert {n: vars(_Backend)[n] for n in _NAMES} == originals
    assert not to_device._active


def test_a_converted_key_is_loaded_once_for_programs_bound_one_by_one(tmp_path, monkeypatch):
    # Each exported program binds its own converted copy of a key stored in another
    # dtype (another view each time): the device copy is still made once per key.
    torch.manual_seed(0)
    model = Mlp().eval()
    path = tmp_path / "mlp16.safetensors"
    st.save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}, path)
    monkeypatch.setattr(adapter, "cuda_backend", lambda: _Backend)
    monkeypatch.setattr(DeviceLoads, "staging_for", lambda self, device: HostStaging(CHUNK))
    _Backend.moved, _Backend.released = [], []
    with weights_from(path) as weights:
        for batch in (1, 2):  # one program per method, each bound on its own
            ep = weights.export(weights.model(Mlp), (torch.randn(batch, 64),))
            c = _Backend.copy_exported_program_for_preprocess(ep, [])
            _Backend.move_program_to_device(c, "cuda", [])
        first, second = _Backend.moved
        for k, v in model.state_dict().items():
            assert torch.equal(first[k].detach(), v.to(torch.bfloat16).to(torch.float32)), k
            assert second[k].untyped_storage().data_ptr() == first[k].untyped_storage().data_ptr(), k
        stats = weights.device_loads.stats
        n = len(model.state_dict())
        assert (stats.loaded, stats.reused, stats.converted) == (n, n, n)


@pytest.mark.parametrize("second", ["weights_from", "stream_cuda_weights"])
@pytest.mark.parametrize("first_out", ["older", "newer"])
def test_no_registration_outlives_the_contexts_in_any_exit_order(tmp_path, monkeypatch, second, first_out):
    """weights_from A, then B (another weights_from, or stream_cuda_weights, which
    shares too) open at once; one exits, the other's program is lowered (copy, move),
    then it exits: no shared storage nor host name is left registered."""
    import contextlib

    from ptdstream.hooks.cuda.routing import CudaWeightStream

    model, path = _checkpoint(tmp_path)
    other = tmp_path / "other.safetensors"
    st.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, other)
    monkeypatch.setattr(adapter, "cuda_backend", lambda: _Backend)
    monkeypatch.setattr(DeviceLoads, "staging_for", lambda self, device: HostStaging(CHUNK))
    _Backend.moved, _Backend.released = [], []
    originals = {n: vars(_Backend)[n] for n in _NAMES}
    a, b = contextlib.ExitStack(), contextlib.ExitStack()
    wa = a.enter_context(weights_from(path))
    wb = b.enter_context(weights_from(other)) if second == "weights_from" else None
    if wb is None:
        b.enter_context(CudaWeightStream())
    exported = (wb or wa).export((wb or wa).model(Mlp), (torch.randn(2, 64),))
    (a if first_out == "older" else b).close()
    c = _Backend.copy_exported_program_for_preprocess(exported, [])
    assert all(c.state_dict[k] is v for k, v in exported.state_dict.items())
    _Backend.move_program_to_device(c, "cuda", [])
    assert sharing.shared_count() > 0
    (b if first_out == "older" else a).close()
    assert sharing.shared_count() == 0 and sharing._hosts == {} and sharing._contexts == {}
    assert {n: vars(_Backend)[n] for n in _NAMES} == originals and not to_device._active


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_a_bound_constant_written_in_place_is_loaded_with_its_new_bytes(tmp_path, monkeypatch, stored):
    """The bound constants are views of a copy-on-write mapping (the checkpoint's, or
    the converted copy's): one edited in place is loaded from its memory (what
    ``.to("cuda")`` copies) (as is one sharing a page with it)."""
    torch.manual_seed(0)
    model = Mlp().eval()
    path = tmp_path / "mlp.safetensors"
    st.save_file({k: v.to(stored).contiguous() for k, v in model.state_dict().items()}, path)
    monkeypatch.setattr(adapter, "cuda_backend", lambda: _Backend)
    monkeypatch.setattr(DeviceLoads, "staging_for", lambda self, device: HostStaging(CHUNK))
    _Backend.moved, _Backend.released = [], []
    with weights_from(path) as weights:
        ep = weights.export(weights.model(Mlp), (torch.randn(2, 64),))
        with torch.no_grad():
            ep.state_dict["l2.bias"].add_(1)
            ep.state_dict["l1.weight"][3, 5] = 7.5
        expected = {k: v.detach().clone() for k, v in ep.state_dict.items()}
        plans = {k: weights.device_loads.plan(k, v) for k, v in ep.state_dict.items()}
        for k in ("l2.bias", "l1.weight"):
            assert plans[k].path is None and plans[k].source.read_file is False, k  # its memory
        _Backend.move_program_to_device(_Backend.copy_exported_program_for_preprocess(ep, []), "cuda", [])
        got = _Backend.moved[0]
        for k, v in expected.items():
            assert got[k].untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
            assert _bytes(got[k]) == _bytes(v), k
        file_bias = model.l2.bias.detach().to(stored).to(torch.float32)
        assert not torch.equal(got["l2.bias"].detach(), file_bias)
        assert float(got["l1.weight"][3, 5]) == 7.5
        assert weights.device_loads.stats.loaded == len(expected)


class _WritingStaging(HostStaging):
    """A staging that writes to the bound tensor while its first piece is sent."""

    def __init__(self, victim: torch.Tensor) -> None:
        super().__init__(CHUNK)
        self.victim = victim

    def send(self, i, dst, nbytes):
        if i == 0:
            self.victim[-1] = 42.0
        super().send(i, dst, nbytes)


def test_a_bound_constant_written_while_loaded_from_the_file_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "w.safetensors"
    st.save_file({"w": torch.ones(4 * CHUNK)}, path)
    ck, loads = _open(path)
    with ck:
        view = ck.tensor("w")
        load = loads.plan("w", view)
        assert load.path == str(path) and load.memory == (view.data_ptr(), 16 * CHUNK)
        with pytest.raises(IntegrityError) as e:
            load_to_device(load, _WritingStaging(view))
        msg = str(e.value)
        assert f"{path}: key 'w'" in msg and f"{16 * CHUNK} bytes) was written to while it was loaded" in msg
        assert f"to the device from {path}: nothing loaded" in msg
        assert float(view[-1]) == 42.0 and path.read_bytes().count(b"\x00\x00\x80\x3f") == 4 * CHUNK
        again = loads.plan("w", view)  # written: now loaded from its memory
        assert again.path is None and _bytes(load_to_device(again, HostStaging(CHUNK))) == _bytes(view.clone())


_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _same_but_nan_payloads(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every non-NaN element bit-identical, every NaN a NaN (sign and payload free)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(_BITS[got.dtype])[~nan], want.view(_BITS[want.dtype])[~nan])


@pytest.mark.parametrize("piece", [24, CHUNK, CHUNK_NBYTES])
@pytest.mark.parametrize(("stored", "wanted"), [(a, b) for a in _BITS for b in _BITS if a != b])
def test_converted_bytes_are_tos_for_every_non_nan_value(tmp_path, stored, wanted, piece):
    """The binding's piecewise conversion and the device load's give ``.to``'s bits
    for every non-NaN value (random bit patterns: subnormals, infinities, both
    zeros) and a NaN for every NaN; a NaN's sign and payload bits are torch's
    vectorized or scalar loop's, which differ (so does ``.to`` itself across
    thread counts). Larger than two pieces of the device load at the real size."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # .to splits among threads: a NaN's bits differ at the split
    try:
        _compare_conversions(tmp_path, stored, wanted, piece)
    finally:
        torch.set_num_threads(threads)


def _compare_conversions(tmp_path, stored, wanted, piece):
    n = 2 * (CHUNK_NBYTES // 4) + 1001 if piece == CHUNK_NBYTES else 40 * CHUNK // 4 + 3
    g = torch.Generator().manual_seed(piece)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(_BITS[stored])
    values = bits.view(stored).clone()
    assert 0 < int(values.isnan().sum()) < n
    path = tmp_path / "w.safetensors"
    st.save_file({"w": values}, path)
    ck, loads = _open(path)
    with ck:
        convert = ConvertDir()
        entry = ck.entries["w"]
        bound = convert.convert(ck.source("w"), stored, wanted, entry.shape, entry.dim_order, "w", piece)
        want = ck.tensor("w").to(wanted)
        _same_but_nan_payloads(bound, want)
        loads.add("w", bound)
        load = loads.plan("w", bound)
        assert load.path == str(path) and (load.stored, load.dtype) == (stored, wanted)
        out = load_to_device(load, HostStaging(piece))
        _same_but_nan_payloads(out, want)
        _same_but_nan_payloads(out, bound)
        convert.close()
