"""torchao's quantize_ on storage-less weights inside weights_from: each weight read
from the checkpoint (converted to the model's dtype), quantized by torchao's own
handler on its module, its quantized tensors moved to nameless files; the saved
program is byte for byte executorch's own serialization of the same script on
loaded weights (sha256 of model.pte), bf16 checkpoints exported in fp32, tied
embeddings in upstream's untie order, large weights in bands of rows."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import warnings

import pytest
import torch
from _checkpoints import safetensors_offset, save_checkpoint, state_of
from _llama import Llama, methods, seeded
from conftest import mapping_rss
from torchao.quantization import quantize_  # imported before any context opens, as scripts do
from torchao.quantization.granularity import PerAxis, PerGroup
from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
from torchao.utils import unwrap_tensor_subclass

import ptdstream
from ptdstream.errors import IntegrityError
from ptdstream.weightless import BindingError, banded, is_storage_less, quantization, quantized_configs, weights_from

warnings.filterwarnings("ignore")

EMBEDDING_8W = IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0),
                                    intx_choose_qparams_algorithm="hqq_scale_only")  # optimum's --qembedding 8w
LINEAR_8DA4W = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32),
                                                     intx_choose_qparams_algorithm="hqq_scale_only")  # --qlinear 8da4w
ROW_WISE = {
    "8da4w-hqq-g32": LINEAR_8DA4W,
    "8da4w-affine-g128": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                               weight_granularity=PerGroup(128)),  # LLM exporter
    "8da8w": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0),
                                                   intx_choose_qparams_algorithm="hqq_scale_only"),
    "8w": EMBEDDING_8W,
    "4w-g32": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32),
                                   intx_choose_qparams_algorithm="hqq_scale_only"),
    "4w-affine-g64": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(64)),
}


class Biased(torch.nn.Module):
    """An embedding and two linears, one with a bias: torchao's quantize_ used directly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 64)
        self.up = torch.nn.Linear(64, 128, bias=True)
        self.down = torch.nn.Linear(128, 32, bias=False)

    def forward(self, tokens):
        return self.down(torch.relu(self.up(self.embed(tokens))))


TOKENS = (torch.tensor([[3, 17, 42, 95, 5]]),)


def _quantize(model) -> None:
    """optimum's order: embeddings (8w) first, then every linear (8da4w); then unwrapped."""
    quantize_(model, EMBEDDING_8W, lambda m, fqn: isinstance(m, torch.nn.Embedding))
    quantize_(model, LINEAR_8DA4W, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear))
    unwrap_tensor_subclass(model)


def _xnnpack(programs):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    return to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()]).to_executorch(
        ExecutorchBackendConfig(do_quant_fusion_and_const_prop=True))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _loaded(cls, ckpt_state):
    """The model as from_pretrained(dtype=float32) loads the checkpoint: values converted to float32."""
    model = cls().eval()
    model.load_state_dict({k: v.to(torch.float32) for k, v in ckpt_state.items()})
    return model


@pytest.mark.parametrize("kind, dtype, spill", [("safetensors", torch.float32, False),
                                                ("safetensors", torch.bfloat16, True), ("torch", torch.float32, False)],
                         ids=["st-fp32", "st-bf16-spilled", "torch-fp32"])
def test_quantized_module_with_biases_is_executorchs_bytes(tmp_path, monkeypatch, kind, dtype, spill):
    """spilled: XNNPACK's packed 4-bit weights and scales (from 1 byte on, for the test) go to nameless files."""
    from ptdstream.hooks import xnnpack

    spilled = []
    if spill:
        real_spilled = xnnpack._spilled
        monkeypatch.setattr(xnnpack, "SPILL_MIN_NBYTES", 1)
        monkeypatch.setattr(xnnpack, "_spilled", lambda view, f: spilled.append(len(view)) or real_spilled(view, f))
    torch.manual_seed(0)
    state = {k: v.to(dtype) for k, v in state_of(Biased()).items()}
    ckpt = save_checkpoint(kind, state, tmp_path / "ckpt")
    real = _loaded(Biased, state)
    _quantize(real)
    want = _xnnpack(torch.export.export(real, TOKENS)).buffer  # executorch's own serializer

    with weights_from(ckpt) as weights:
        with torch.device("meta"):
            model = Biased().eval()
        model = weights.model(model)
        _quantize(model)
        assert weights.quantized_keys == ["embed.weight", "up.weight", "down.weight"]
        assert is_storage_less(model.up.bias)  # bound as a plain weight at lowering
        qdata = model.up.parametrizations.weight.original0
        assert not is_storage_less(qdata) and _file_backed(qdata)
        manager = _xnnpack(torch.export.export(model, TOKENS))
        (tmp_path / "out").mkdir()
        ptdstream.save(manager, str(tmp_path / "out" / "model.pte"))
        assert weights.bound_keys == ["up.bias"]
        assert (len(spilled) >= 4) == spill  # hash and add of the two 4-bit weights and their scales, at least
        assert os.listdir(weights.convert_dir.folder) == []  # nameless files only
    with open(tmp_path / "out" / "model.pte", "rb") as f:
        assert _sha(f.read()) == _sha(want)


def test_xnnpack_packs_the_4bit_weights_band_by_band_into_files_with_upstreams_bytes(tmp_path, monkeypatch):
    """Every 4-bit weight packed in bands of 3 rows (its size threshold lowered for the
    test) straight into a nameless file, referenced by the NamedDataStore, never
    spilled (copied) again: the program's sha256 is upstream's."""
    from ptdstream.hooks import xnnpack, xnnpack_qc4w

    packed, spilled = [], []
    real_pack, real_spilled = xnnpack_qc4w.pack_qc4w_in_bands, xnnpack._spilled
    monkeypatch.setattr(xnnpack_qc4w, "BANDED_MIN_NBYTES", 1)
    monkeypatch.setattr(xnnpack_qc4w, "BAND_NBYTES", 3 * 128)
    monkeypatch.setattr(xnnpack_qc4w, "pack_qc4w_in_bands",
                        lambda inp, sink, *a: packed.append(tuple(inp.shape)) or real_pack(inp, sink, *a))
    monkeypatch.setattr(xnnpack, "SPILL_MIN_NBYTES", 1)
    monkeypatch.setattr(xnnpack, "_spilled", lambda view, f: spilled.append(len(view)) or real_spilled(view, f))
    torch.manual_seed(0)
    state = {k: v.to(torch.bfloat16) for k, v in state_of(Biased()).items()}
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    real = _loaded(Biased, state)
    _quantize(real)
    want = _xnnpack(torch.export.export(real, TOKENS)).buffer

    with weights_from(ckpt) as weights:
        with torch.device("meta"):
            model = Biased().eval()
        model = weights.model(model)
        _quantize(model)
        manager = _xnnpack(torch.export.export(model, TOKENS))
        (tmp_path / "out").mkdir()
        ptdstream.save(manager, str(tmp_path / "out" / "model.pte"))
    assert sorted(packed) == [(32, 128), (128, 64)]  # down, up: int8 values, one per 4-bit weight
    assert 128 * 64 // 2 not in spilled and 32 * 128 // 2 not in spilled  # their scales are spilled, not they
    with open(tmp_path / "out" / "model.pte", "rb") as f:
        assert _sha(f.read()) == _sha(want)


def _file_backed(tensor) -> bool:
    from ptdstream.system.pagecache import file_mapping

    storage = tensor.untyped_storage()
    return file_mapping(storage.data_ptr(), storage.nbytes()) is not None


@pytest.mark.slow
@pytest.mark.parametrize("key_map", [{"lm_head.weight": "embed.weight"}, None], ids=["key_map", "found"])
def test_tied_embedding_is_quantized_twice_in_upstreams_order(tmp_path, key_map):
    """embed (8w) first gives it a new parameter, which unties lm_head; lm_head (8da4w) then reads the same key
    (the checkpoint holds 'embed.weight' only: without a key_map, the tie seen at the first quantize_ finds it)."""
    real = seeded()
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    _quantize(real)
    prefill = methods()["prefill"]
    want = _xnnpack({"prefill": torch.export.export(real, prefill)}).buffer

    with weights_from(ckpt, key_map=key_map) as weights:
        model = weights.model(Llama)
        assert model.lm_head.weight is model.embed.weight
        _quantize(model)
        assert weights.quantized_keys[0] == "embed.weight"  # the one key, read twice
        assert type(model.embed.parametrizations.weight[0]).__name__ == "UnwrapTensorSubclass"
        embed, lm_head = model.embed.parametrizations.weight, model.lm_head.parametrizations.weight
        assert embed.original0.shape == lm_head.original0.shape == (128, 64)
        assert model.embed.parametrizations.weight.original1.shape == (128, 1)  # 8w: one scale a row
        assert model.lm_head.parametrizations.weight.original1.shape == (128, 2)  # 8da4w: groups of 32
        manager = _xnnpack({"prefill": torch.export.export(model, prefill)})
        (tmp_path / "out").mkdir()
        ptdstream.save(manager, str(tmp_path / "out" / "model.pte"))
    with open(tmp_path / "out" / "model.pte", "rb") as f:
        assert _sha(f.read()) == _sha(want)


@pytest.mark.parametrize("name", list(ROW_WISE))
def test_a_large_weight_quantized_in_bands_of_rows_gives_the_whole_tensors_bytes(tmp_path, monkeypatch, name):
    """Rows are quantized independently (per-row and per-group scales): bands of 7 rows give the
    bytes of the tensor quantized whole, Inf rows included (a NaN too under HQQ; under ``affine`` a NaN
    takes the weight whole: the next test). ``hqq_scale_only`` stops its
    iterations on the largest change over the whole tensor: a first pass over the bands finds that
    iteration; a NaN keeps the whole tensor iterating to torchao's last, so the first pass's bands
    are the tensor's and no second pass runs."""
    config = ROW_WISE[name]
    # from the config, not quantization._hqq (False in a process where no context has opened yet)
    hqq = quantized_configs.named(config.intx_choose_qparams_algorithm, "hqq_scale_only")
    torch.manual_seed(1)
    weight = torch.randn(61, 256)
    weight[10, :], weight[20, 7] = float("inf"), -float("inf")
    if hqq:  # under affine a NaN takes the tensor whole: the next test
        weight[3, 5] = float("nan")
    ckpt = save_checkpoint("safetensors", {"lin.weight": weight}, tmp_path / "ckpt")
    real = _real_linear(weight, config)

    calls = _handler_calls(monkeypatch)
    _banded_from_1_kib(monkeypatch, 7 * 256 * 4)
    with weights_from(ckpt) as weights:
        model = _storage_less_linear(weights, 256, 61)
        quantize_(model, config)
        got, want = model.lin.weight, real.lin.weight
        assert calls == [7] * hqq + [7] * 8 + [5]  # nine bands of rows, once (HQQ: its first band probed before)
        assert type(got) is type(want) and got.__tensor_flatten__()[1] == want.__tensor_flatten__()[1]
        for inner in want.__tensor_flatten__()[0]:
            a, b = getattr(got, inner), getattr(want, inner)
            assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
        _assert_same_bytes_file_backed(got, want)


@pytest.mark.parametrize("name", ["8da8w-affine", "8w-affine-g32"])
def test_a_nan_under_affine_takes_the_weight_whole_with_upstreams_nan_bits(tmp_path, monkeypatch, name):
    """Under ``affine`` torch's min/max give a NaN scale other sign and payload bits in a band of
    2730 rows than in the whole 6000 (0x7fc00000 against 0xffffffff, the adversary's case): a band
    holding a NaN sends the weight to one whole-tensor call, whose bytes are upstream's; a weight
    without NaN stays in bands."""
    config = {"8da8w-affine": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8,
                                                                    weight_granularity=PerAxis(0)),
              "8w-affine-g32": IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(32))}[name]
    torch.manual_seed(0)
    clean = torch.randn(6000, 96) * 0.1
    weight = clean.clone()
    weight[2725, 5] = float("nan")
    real = _real_linear(weight, config)

    calls = _handler_calls(monkeypatch)
    for values, want_calls in ((weight, [6000]), (clean, [2730, 2730, 540])):
        ckpt = save_checkpoint("safetensors", {"lin.weight": values}, tmp_path / f"ckpt{len(want_calls)}")
        calls.clear()
        with weights_from(ckpt) as weights:
            model = _storage_less_linear(weights, 96, 6000)
            quantize_(model, config)
            if values is weight:
                _assert_same_bytes_file_backed(model.lin.weight, real.lin.weight)
            assert calls == want_calls


def _real_linear(weight, config):
    """A ``Sequential`` whose bias-free ``lin`` holds ``weight`` (out x in), quantized by torchao: upstream."""
    real = torch.nn.Sequential()
    real.lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    real.lin.weight = torch.nn.Parameter(weight.clone())
    quantize_(real, config)
    return real


def _storage_less_linear(weights, in_features, out_features):
    """A ``Sequential`` whose bias-free ``lin`` is storage-less, bound to ``weights``' checkpoint (key 'lin.weight')."""
    model = torch.nn.Sequential()
    with torch.device("meta"):
        model.lin = torch.nn.Linear(in_features, out_features, bias=False)
    return weights.model(model)


def _banded_from_1_kib(monkeypatch, band_nbytes) -> None:
    """Weights past 1 KiB quantized in bands of ``band_nbytes`` (in the model's dtype)."""
    monkeypatch.setattr(quantization, "LARGE_NBYTES", 1024)
    monkeypatch.setattr(quantization, "BAND_NBYTES", band_nbytes)


def _handler_calls(monkeypatch) -> list[int]:
    """The rows of each tensor torchao's handler quantizes from now on (a band's, or a whole weight's), in order."""
    calls: list[int] = []
    real_handler = quantization.adapter.quantize_handler
    monkeypatch.setattr(quantization.adapter, "quantize_handler",
                        lambda c: lambda m, cfg: calls.append(m.weight.shape[0]) or real_handler(c)(m, cfg))
    return calls


def _assert_same_bytes_file_backed(got, want) -> None:
    """Each inner tensor of ``want`` (torchao's tensor) byte for byte in ``got``, its inner tensors file-backed."""
    for inner in want.__tensor_flatten__()[0]:
        a, b = getattr(got, inner), getattr(want, inner)
        assert a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8)), inner
        assert _file_backed(a)


def _hqq_weight(name):
    """8-bit per-row (8da8w, 8w): a weight on which a band of 7 rows quantized alone stops earlier than
    the whole tensor (which runs every iteration); 4-bit groups of 32: the whole tensor stops early."""
    torch.manual_seed(1 if name != "4w-g32" else 0)
    return torch.randn(2048, 512)[:128].clone() if name != "4w-g32" else torch.randn(2048, 256)[:256].clone()


@pytest.mark.parametrize("held_nbytes", [32 << 20, 0], ids=["held", "read-again"])
@pytest.mark.parametrize("name", ["8da8w", "8w", "4w-g32"])
def test_hqq_in_bands_gives_the_whole_tensors_bytes_where_a_band_alone_would_stop_elsewhere(
        tmp_path, monkeypatch, name, held_nbytes):
    """HQQ scale-only in bands of 7 rows inside weights_from: every inner tensor is the whole
    tensor's, byte for byte, both where a band quantized alone by torchao gives other bytes (its own
    early stop) and where the whole tensor stops before torchao's last iteration; the bands'
    values held while the iterations run, or read again at each."""
    from ptdstream.weightless import hqq_bands

    config = ROW_WISE[name]
    weight = _hqq_weight(name)
    rows, cols = weight.shape
    linear = name != "8w"

    def module(values):
        m = torch.nn.Sequential()
        m.lin = torch.nn.Linear(cols, len(values), bias=False) if linear else torch.nn.Embedding(len(values), cols)
        m.lin.weight = torch.nn.Parameter(values.clone())
        return m

    kind = torch.nn.Linear if linear else torch.nn.Embedding

    def chosen(m, fqn):
        return isinstance(m, kind)
    real = module(weight)
    quantize_(real, config, chosen)
    want = real.lin.weight
    alone = []
    for r0 in range(0, rows, 7):  # upstream's own handler on each band by itself
        band = module(weight[r0:r0 + 7])
        quantize_(band, config, chosen)
        alone.append(torch.equal(band.lin.weight.qdata, want.qdata[r0:r0 + 7])
                     and torch.equal(band.lin.weight.scale, want.scale[r0:r0 + 7]))

    stops = _recorded_stops(monkeypatch)
    _banded_from_1_kib(monkeypatch, 7 * cols * 4)
    monkeypatch.setattr(banded, "HELD_NBYTES", held_nbytes)
    reads = _row_reads(monkeypatch)
    ckpt = save_checkpoint("safetensors", {"lin.weight": weight}, tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        with torch.device("meta"):
            stand_in = module(torch.empty(rows, cols))
        model = weights.model(stand_in)
        quantize_(model, config, chosen)
        got = model.lin.weight
        for inner in want.__tensor_flatten__()[0]:
            a, b = getattr(got, inner), getattr(want, inner)
            assert (a.dtype, a.shape) == (b.dtype, b.shape), inner
            assert a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8)), inner
            assert _file_backed(a)
    iters = hqq_bands.Search(hqq_bands._Probed([1, 32], -8, 7)).iters
    if name == "4w-g32":  # the whole tensor stops before torchao's last iteration
        assert len(stops) == 1 and stops[0] < iters
    else:  # a band alone stops early; the tensor never does
        assert not all(alone) and stops == [iters]
    nbands = -(-rows // 7)
    # the probe's band, then each band: held once, or read again for the first scales and each iteration; the last pass
    assert len(reads) == 1 + nbands * (1 if held_nbytes else 1 + stops[0]) + nbands


def _recorded_stops(monkeypatch) -> list[int]:
    """The iteration each HQQ search stops at from now on (``banded.hqq_search``), in order."""
    stops: list[int] = []
    real_search = banded.hqq_search
    monkeypatch.setattr(banded, "hqq_search", lambda *a: (lambda r: stops.append(r.stop) or r)(real_search(*a)))
    return stops


def _row_reads(monkeypatch) -> list[tuple[int, int]]:
    """The rows of each read of a weight's source (``RowReader.read``) from now on, in order."""
    from ptdstream.weightless import convert

    reads: list[tuple[int, int]] = []
    real_read = convert.RowReader.read
    monkeypatch.setattr(convert.RowReader, "read", lambda self, r0, r1, *a: reads.append((r0, r1))
                        or real_read(self, r0, r1, *a))
    return reads


def test_levels_that_are_not_torchaos_own_are_not_kept(tmp_path, monkeypatch):
    """The first band's levels at the scales found are compared with torchao's own function
    run for the whole tensor's iterations: where they differ (here made to, as a torchao with
    another loop would), every band goes through torchao's own function for that many
    iterations, and the bytes are still torchao's."""
    from ptdstream.weightless import hqq_bands

    weight = _hqq_weight("8da8w")
    real = _real_linear(weight, ROW_WISE["8da8w"])
    real_levels = hqq_bands._levels
    monkeypatch.setattr(hqq_bands, "_levels", lambda values, scale, qmin, qmax: real_levels(values, scale * 1.5,
                                                                                           qmin, qmax))
    monkeypatch.setattr(hqq_bands, "_checked", {})  # not checked yet in this process
    fixed = []
    real_fixed = banded.fixed_iterations
    monkeypatch.setattr(banded, "fixed_iterations", lambda n: fixed.append(n) or real_fixed(n))
    calls = _handler_calls(monkeypatch)
    _banded_from_1_kib(monkeypatch, 32 * 512 * 4)
    ckpt = save_checkpoint("safetensors", {"lin.weight": weight}, tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        model = _storage_less_linear(weights, 512, 128)
        quantize_(model, ROW_WISE["8da8w"])
        for inner in ("qdata", "scale", "zero_point"):
            a, b = getattr(model.lin.weight, inner), getattr(real.lin.weight, inner)
            assert a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8)), inner
    assert fixed == [hqq_bands.Search(hqq_bands._Probed([1, 32], -8, 7)).iters]  # the whole tensor runs them all
    assert calls == [32] + [32] + [32] * 4  # the probe, the first band refused, four bands of torchao's own


def test_an_interrupt_inside_a_banded_weight_leaves_it_storage_less_and_the_next_quantize_is_upstreams(
        tmp_path, monkeypatch):
    """A KeyboardInterrupt in torchao's handler on a band (the third call) leaves the module's
    weight storage-less, as upstream leaves its weight as it was; quantize_ again gives torchao's bytes."""
    weight = _hqq_weight("8da8w")
    real = _real_linear(weight, ROW_WISE["8da8w"])
    _banded_from_1_kib(monkeypatch, 32 * 512 * 4)
    real_handler = quantization.adapter.quantize_handler
    calls = []

    def interrupted(config):
        def handler(module, cfg):
            calls.append(module.weight.shape[0])
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real_handler(config)(module, cfg)
        return handler

    ckpt = save_checkpoint("safetensors", {"lin.weight": weight}, tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        model = _storage_less_linear(weights, 512, 128)
        with monkeypatch.context() as patch:
            patch.setattr(quantization.adapter, "quantize_handler", interrupted)
            with pytest.raises(KeyboardInterrupt):
                quantize_(model, ROW_WISE["8da8w"])
        assert calls == [32, 32, 32] and is_storage_less(model.lin.weight)
        quantize_(model, ROW_WISE["8da8w"])
        _assert_same_bytes_file_backed(model.lin.weight, real.lin.weight)


def test_a_function_set_in_torchaos_place_runs_by_its_own_defaults(tmp_path, monkeypatch):
    """A user's function set where torchao looks its HQQ function up (three iterations by
    default): the bands stop where it stops the whole tensor, and the bytes are its own."""
    from ptdstream.upstream import adapter
    from ptdstream.weightless import hqq_bands

    module = adapter.intx_unpacked_module()
    torchaos = module._choose_qparams_and_quantize_scale_only_hqq

    def fewer(hp, block_size, qmin, qmax, *, iters=3, stochastic=False, early_stop_tol=1e-5):
        return torchaos(hp, block_size, qmin, qmax, iters=iters, stochastic=stochastic, early_stop_tol=early_stop_tol)

    monkeypatch.setattr(module, "_choose_qparams_and_quantize_scale_only_hqq", fewer)
    weight = _hqq_weight("4w-g32")
    real = _real_linear(weight, ROW_WISE["4w-g32"])
    stops = _recorded_stops(monkeypatch)
    _banded_from_1_kib(monkeypatch, 7 * 256 * 4)
    ckpt = save_checkpoint("safetensors", {"lin.weight": weight}, tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        model = _storage_less_linear(weights, 256, 256)
        quantize_(model, ROW_WISE["4w-g32"])
        _assert_same_bytes_file_backed(model.lin.weight, real.lin.weight)
    assert stops == [3] and hqq_bands.Search(hqq_bands._Probed([1, 32], -8, 7, fewer)).iters == 3


def test_a_checkpoint_truncated_while_a_weight_is_read_again_is_refused_not_sigbus(tmp_path, monkeypatch):
    """The file truncated under the mapping between two reads of a band (a read would kill the
    process with SIGBUS): IntegrityError naming the key, the rows, their offset and the file."""
    from ptdstream.weightless import convert

    weight = _hqq_weight("8da8w")
    ckpt = save_checkpoint("safetensors", {"lin.weight": weight}, tmp_path / "ckpt")
    _banded_from_1_kib(monkeypatch, 32 * 512 * 4)
    monkeypatch.setattr(banded, "HELD_NBYTES", 0)
    real_read = convert.RowReader.read
    reads = []

    def read(self, r0, r1, *a):
        reads.append(r0)
        if len(reads) == 6:  # the probe's band and the first scales of four: then cut the file
            os.truncate(ckpt, 4096)
        return real_read(self, r0, r1, *a)

    monkeypatch.setattr(convert.RowReader, "read", read)
    with weights_from(ckpt) as weights:
        model = _storage_less_linear(weights, 512, 128)
        with pytest.raises(IntegrityError) as caught:
            quantize_(model, ROW_WISE["8da8w"])
        assert is_storage_less(model.lin.weight)
    at = safetensors_offset(ckpt, "lin.weight")
    assert str(caught.value) == (f"key 'lin.weight': rows [0, 32) at offset {at:,} of checkpoint file {ckpt}: the "
                                 f"file was truncated after it was mapped (needs {at + 32 * 512 * 4:,} bytes, has "
                                 "4,096); nothing is quantized from it")


def test_the_levels_are_checked_against_torchaos_own_function_once_per_kind_of_weight(tmp_path, monkeypatch):
    """Two large 8da8w weights of one kind and a third of another group size, quantized inside
    weights_from: torchao's own function runs on one band for each kind (the check), not for each
    weight, and every weight's bytes are torchao's."""
    from ptdstream.upstream import adapter
    from ptdstream.weightless import hqq_bands

    module = adapter.intx_unpacked_module()
    real_hqq = module._choose_qparams_and_quantize_scale_only_hqq
    checks = []

    @functools.wraps(real_hqq)  # its signature is torchao's: its defaults are the ones the search runs by
    def counted(hp, block_size, qmin, qmax, **kwargs):
        if kwargs.get("early_stop_tol") == float("-inf"):
            checks.append((tuple(hp.shape), int(block_size[1])))
        return real_hqq(hp, block_size, qmin, qmax, **kwargs)

    monkeypatch.setattr(module, "_choose_qparams_and_quantize_scale_only_hqq", counted)
    monkeypatch.setattr(hqq_bands, "_checked", {})
    _banded_from_1_kib(monkeypatch, 16 * 512 * 4)
    torch.manual_seed(3)
    state = {"a.weight": torch.randn(48, 512), "b.weight": torch.randn(48, 512), "c.weight": torch.randn(48, 256)}
    config = ROW_WISE["8da8w"]

    def build():
        m = torch.nn.Sequential()
        m.a, m.b, m.c = (torch.nn.Linear(512, 48, bias=False), torch.nn.Linear(512, 48, bias=False),
                         torch.nn.Linear(256, 48, bias=False))
        return m

    real = build()
    real.load_state_dict(state)
    quantize_(real, config)
    checks.clear()
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        with torch.device("meta"):
            model = build()
        model = weights.model(model)
        quantize_(model, config)
        for name in ("a", "b", "c"):
            for inner in ("qdata", "scale"):
                x, y = getattr(getattr(model, name).weight, inner), getattr(getattr(real, name).weight, inner)
                assert x.contiguous().view(torch.uint8).equal(y.contiguous().view(torch.uint8)), (name, inner)
    assert checks == [((16, 512), 512), ((32, 256), 256)]  # a's first band, c's first band; not b's


def test_no_band_is_one_row_alone_whose_whole_row_scale_torch_would_sum_across_threads(tmp_path, monkeypatch):
    """15 rows of 40000 (one scale a row, 8w): bands of 7 would leave one row alone, whose sums torch
    splits across threads (one output) in another order than the whole tensor's; it joins the band
    before it, and the bytes are the whole tensor's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(2)  # a last row whose sums torch orders otherwise when it is alone
        weight = torch.randn(15, 40000)
        real = torch.nn.Sequential()
        real.lin = torch.nn.Embedding(15, 40000)
        real.lin.weight = torch.nn.Parameter(weight.clone())
        def embeddings(m, fqn):
            return isinstance(m, torch.nn.Embedding)

        quantize_(real, EMBEDDING_8W, embeddings)
        monkeypatch.setattr(quantization, "LARGE_NBYTES", 1024)
        monkeypatch.setattr(quantization, "BAND_NBYTES", 7 * 40000 * 4)
        ckpt = save_checkpoint("safetensors", {"lin.weight": weight}, tmp_path / "ckpt")
        with weights_from(ckpt) as weights:
            model = torch.nn.Sequential()
            with torch.device("meta"):
                model.lin = torch.nn.Embedding(15, 40000)
            model = weights.model(model)
            quantize_(model, EMBEDDING_8W, embeddings)
            for inner in ("qdata", "scale", "zero_point"):
                a, b = getattr(model.lin.weight, inner), getattr(real.lin.weight, inner)
                assert a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8)), inner
    finally:
        torch.set_num_threads(threads)
    assert banded.bands(15, 7) == [(0, 7), (7, 15)]
    assert banded.bands(14, 7) == [(0, 7), (7, 14)]
    assert banded.bands(5, 1) == [(0, 2), (2, 5)]


def test_the_search_keeps_no_graph_of_a_parameters_band():
    """The scales a search keeps of a band that requires grad hold no autograd graph (it would keep
    every iteration's band-sized tensors)."""
    from ptdstream.weightless.hqq_bands import Search, _Probed

    band = torch.nn.Parameter(torch.randn(8, 64))
    search = Search(_Probed([1, 32], -8, 7))
    search.run(lambda i: band, [(0, 8)])
    assert 1 <= search.stop <= search.iters and len(search.scales) == 1
    assert not search.scales[0].requires_grad and tuple(search.scales[0].shape) == (8, 2)


def test_the_whole_tensors_stop_is_the_first_iteration_every_band_is_below_the_tolerance_and_nan_never_is(
        monkeypatch):
    from ptdstream.weightless import hqq_bands

    def stop_of(per_band):
        """The search's stop where band ``b``'s change at iteration ``i`` is ``per_band[b][i]``."""
        seen = {}

        def scripted(values, previous, qmin, qmax):
            b = int(values[0, 0, 0])
            i = seen[b] = seen.get(b, -1) + 1
            return previous, torch.tensor(per_band[b][i], dtype=torch.float32)

        monkeypatch.setattr(hqq_bands, "_iteration", scripted)
        search = hqq_bands.Search(hqq_bands._Probed([1, 2], -8, 7))
        search.iters, search.tol = 4, 1e-5
        search.run(lambda b: torch.full((1, 2), float(b)), [(b, b + 1) for b in range(len(per_band))])
        return search.stop

    assert stop_of([[1e-3, 0.0, 0.0, 0.0], [1e-3, 2e-5, 9e-6, 0.0]]) == 3
    assert stop_of([[1e-3, 0.0, 0.0, 0.0], [1e-3, 2e-5, 9e-6, 0.0], [1e-3, 0.0, float("nan"), 0.0]]) == 4
    assert stop_of([[float("nan")] * 4]) == 4
    assert stop_of([[0.0] * 4]) == 1  # as torchao: at least one iteration


def test_a_strict_export_copies_no_quantized_weight_into_dynamos_real_value_cache(tmp_path, monkeypatch):
    """A strict torch.export (optimum's) copies each real tensor it wraps (torch/_dynamo/variables/builder.py,
    clone_input): upstream's export copies every quantized tensor; inside weights_from none, the bytes the same,
    and the pages tracing and packing read of the quantized tensors' files are unmapped again."""
    import torch._dynamo.variables.builder as builder

    cloned: list[tuple] = []
    real_clone = builder.clone_input
    monkeypatch.setattr(builder, "clone_input", lambda x, *a, **k: cloned.append((str(x.dtype), tuple(x.shape)))
                        or real_clone(x, *a, **k))
    torch.manual_seed(0)
    state = state_of(Biased())
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    real = _loaded(Biased, state)
    _quantize(real)
    quantized = sorted((str(t.dtype), tuple(t.shape)) for n, t in real.named_parameters() if "parametrizations" in n)
    want = _xnnpack(torch.export.export(real, TOKENS, strict=True)).buffer
    assert set(quantized) <= set(cloned)  # upstream: each one copied (at least once)

    cloned.clear()
    with weights_from(ckpt) as weights:
        model = weights.model(Biased)
        _quantize(model)
        program = torch.export.export(model, TOKENS, strict=True)
        assert cloned and not [c for c in cloned if c in quantized]  # the cache holds the mapped tensors themselves
        qdata = model.up.parametrizations.weight.original0
        assert int(qdata.to(torch.int64).abs().sum()) > 0  # its file's pages mapped in
        assert _mapping_rss(qdata) > 0
        manager = _xnnpack(program)
        assert _mapping_rss(qdata) == 0  # unmapped before emission, after XNNPACK packed it
        (tmp_path / "out").mkdir()
        ptdstream.save(manager, str(tmp_path / "out" / "model.pte"))
    with open(tmp_path / "out" / "model.pte", "rb") as f:
        assert _sha(f.read()) == _sha(want)


def _mapping_rss(tensor) -> int:
    """Bytes of ``tensor``'s file mapping resident in this process (``/proc/self/smaps``)."""
    from ptdstream.system.pagecache import file_mapping

    mapping = file_mapping(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
    assert mapping is not None
    return mapping_rss(mapping.start)


def test_a_checkpoint_changed_after_quantization_is_refused_before_emission(tmp_path):
    torch.manual_seed(0)
    state = state_of(Biased())
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    # and again as the block exits: its quantized weights hold the values from before the change
    with pytest.raises(IntegrityError, match=r"before weights_from exited \(its converted copies and quantized "
                                             r"weights hold the values from before the change\): 3 bound key\(s\) "
                                             r"come from it: 'embed.weight', 'up.weight', 'down.weight'"):
        with weights_from(ckpt) as weights:
            model = weights.model(Biased)
            _quantize(model)
            program = torch.export.export(model, TOKENS)
            with open(ckpt, "r+b") as f:  # the same bytes written again: a new modification time
                data = f.read()
                f.seek(0)
                f.write(data)
            # refused at the first read of a bound constant (XNNPACK's lowering reads them), naming the file
            with pytest.raises(IntegrityError, match=rf"its checkpoint file {re.escape(str(ckpt))} was written to "
                                                     r"after it was opened .*; nothing is written from it"):
                _xnnpack(program)


class _Quantized(torch.nn.Module):
    """Two bias-free linears: once quantized and lowered, the save reads nothing from the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 128, bias=False)
        self.down = torch.nn.Linear(128, 32, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_a_checkpoint_changed_after_lowering_is_refused_by_the_save_and_an_existing_output_kept(tmp_path):
    """Every weight quantized and lowered: the program holds values read before the change and the
    save reads nothing from the checkpoint; it refuses before its first folder step, the output
    that was there kept, no other file made (the adversary's case: it published, then the block's
    exit reported the change)."""
    torch.manual_seed(0)
    ckpt = save_checkpoint("safetensors", state_of(_Quantized()), tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pte").write_bytes(b"OLD-CONTENT")
    with pytest.raises(IntegrityError, match=r"before weights_from exited"):  # and again as the block exits
        with weights_from(ckpt) as weights:
            model = weights.model(_Quantized)
            quantize_(model, LINEAR_8DA4W)
            unwrap_tensor_subclass(model)
            manager = _xnnpack(torch.export.export(model, (torch.randn(2, 64),)))
            with open(ckpt, "r+b") as f:  # the last 4 bytes: the end of 'up.weight' or 'down.weight'
                f.seek(-4, os.SEEK_END)
                f.write(b"\x01\x02\x03\x04")
            with pytest.raises(IntegrityError) as caught:
                ptdstream.save(manager, str(out / "model.pte"))
            assert str(caught.value).startswith(f"checkpoint file {os.path.realpath(ckpt)}: written to after an "
                                                "open weights_from opened it"), caught.value
    assert os.listdir(out) == ["model.pte"]
    assert (out / "model.pte").read_bytes() == b"OLD-CONTENT"


def test_a_weight_the_group_size_does_not_divide_is_named_before_anything_is_read_and_a_missing_key_too(tmp_path):
    from ptdstream.weightless import QuantizationShapeError

    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
    ckpt = save_checkpoint("safetensors", {"0.weight": torch.randn(8, 48), "1.weight": torch.randn(8, 64)},
                           tmp_path / "ckpt")
    with pytest.raises(AssertionError, match="48 to be divisible by block_size at 1 dimension: 32"):
        quantize_(torch.nn.Sequential(torch.nn.Linear(48, 8, bias=False)), config)  # upstream: a bare assert
    with weights_from(ckpt) as weights:
        model = weights.model(lambda: torch.nn.Sequential(torch.nn.Linear(48, 8, bias=False),
                                                          torch.nn.Linear(64, 8, bias=False)))
        with pytest.raises(QuantizationShapeError) as misfit:
            quantize_(model, config)
        assert is_storage_less(model[0].weight) and is_storage_less(model[1].weight)  # the fitting one unread too
        other = weights.model(lambda: torch.nn.Sequential(torch.nn.Linear(48, 8, bias=False),
                                                          torch.nn.Linear(64, 8, bias=False),
                                                          torch.nn.Linear(64, 8, bias=False)))
        with pytest.raises(BindingError) as missing:
            quantize_(other, config, filter_fn=lambda m, fqn: fqn == "2")
        assert is_storage_less(other[2].weight)
    assert misfit.value.problems == [f"'0.weight' <- key '0.weight' ({ckpt}) float32[8, 48]: group size 32 does not "
                                     "divide its last dimension (48)"]
    assert str(misfit.value).startswith("torchao quantize_ (Int8DynamicActivationIntxWeightConfig): 1 weight(s) "
                                        "cannot be quantized with this config (nothing read):\n  '0.weight'")
    assert missing.value.problems == ["missing: '2.weight' (quantized by quantize_) needs checkpoint key '2.weight', "
                                      "which the checkpoint does not hold"]


def _is_conv(module, fqn) -> bool:
    return isinstance(module, torch.nn.Conv2d)


def test_a_conv2d_weight_is_grouped_along_its_input_channels_as_torchao_groups_it(tmp_path, monkeypatch):
    """``IntxWeightOnlyConfig`` groups a 4-D (Conv2d) weight along its input channels (block
    ``(1, group, 1, 1)``): 64 channels in groups of 32 quantize in bands of output channels to
    torchao's bytes; 48 are named before anything is read, where torchao raises a bare assert.
    Under ``hqq_scale_only`` (2-D alone in torchao) a large 4-D weight goes whole, to torchao's own error."""
    from ptdstream.weightless import QuantizationShapeError

    config = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    hqq = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32),
                               intx_choose_qparams_algorithm="hqq_scale_only")
    torch.manual_seed(0)
    fits, misfit = torch.randn(20, 64, 3, 3), torch.randn(8, 48, 3, 3)
    real = torch.nn.Sequential(torch.nn.Conv2d(64, 20, 3, bias=False))
    real[0].weight = torch.nn.Parameter(fits.clone())
    quantize_(real, config, filter_fn=_is_conv)
    with pytest.raises(AssertionError, match="48 to be divisible by block_size at 1 dimension: 32"):
        quantize_(torch.nn.Sequential(torch.nn.Conv2d(48, 8, 3, bias=False)), config, filter_fn=_is_conv)

    ckpt = save_checkpoint("safetensors", {"0.weight": fits, "1.weight": misfit}, tmp_path / "ckpt")
    calls = _handler_calls(monkeypatch)
    _banded_from_1_kib(monkeypatch, 6 * 64 * 9 * 4)
    with weights_from(ckpt) as weights:
        model = weights.model(lambda: torch.nn.Sequential(torch.nn.Conv2d(64, 20, 3, bias=False)))
        quantize_(model, config, filter_fn=_is_conv)
        assert calls == [6, 6, 6, 2]
        _assert_same_bytes_file_backed(model[0].weight, real[0].weight)
        other = weights.model(lambda: torch.nn.Sequential(torch.nn.Conv2d(64, 20, 3, bias=False),
                                                          torch.nn.Conv2d(48, 8, 3, bias=False)))
        with pytest.raises(QuantizationShapeError) as caught:
            quantize_(other, config, filter_fn=_is_conv)
        assert is_storage_less(other[0].weight) and is_storage_less(other[1].weight)
        with pytest.raises(AssertionError) as ours:
            quantize_(weights.model(lambda: torch.nn.Sequential(torch.nn.Conv2d(64, 20, 3, bias=False))), hqq,
                      filter_fn=_is_conv)
        with pytest.raises(AssertionError) as ours_misfit:  # a group that does not divide: still torchao's error
            quantize_(weights.model(lambda: torch.nn.Sequential(torch.nn.Conv2d(64, 20, 3, bias=False))),
                      IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(48),
                                           intx_choose_qparams_algorithm="hqq_scale_only"), filter_fn=_is_conv)
    with pytest.raises(AssertionError) as upstream:
        quantize_(torch.nn.Sequential(torch.nn.Conv2d(64, 20, 3, bias=False)), hqq, filter_fn=_is_conv)
    assert str(ours.value) == str(ours_misfit.value) == str(upstream.value) == "hp_tensor must be 2D [out, in]"
    assert caught.value.problems == [f"'1.weight' <- key '1.weight' ({ckpt}) float32[8, 48, 3, 3]: group size 32 "
                                     "does not divide its dimension 1 (input channels) (48)"]


def test_fqn_to_config_on_storage_less_weights_is_refused_by_name_before_anything_is_read(tmp_path):
    from torchao.quantization import FqnToConfig

    from ptdstream.weightless import QuantizationNeedsValuesError

    ckpt = save_checkpoint("safetensors", {"0.weight": torch.randn(8, 64)}, tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        model = weights.model(lambda: torch.nn.Sequential(torch.nn.Linear(64, 8, bias=False)))
        with pytest.raises(QuantizationNeedsValuesError) as caught:
            quantize_(model, FqnToConfig({"0": LINEAR_8DA4W}), filter_fn=None)
        assert is_storage_less(model[0].weight)
    assert caught.value.names == ["'0.weight' (torch.float32 [8, 64])"]
    assert str(caught.value).startswith("torchao quantize_ (FqnToConfig): 1 storage-less weight(s) would be "
                                        "quantized: '0.weight' (torch.float32 [8, 64]); FqnToConfig is not covered "
                                        "(call quantize_ once per config, with a filter_fn): ")


@pytest.mark.parametrize("kind", ["dcp", "hf-sharded"])
def test_dcp_and_sharded_checkpoints_quantize_to_upstreams_tensors(tmp_path, kind):
    """DCP (read through a converted copy, one tensor at a time) and a sharded folder (each
    key from its shard): the quantized tensors are upstream's, bit for bit."""
    torch.manual_seed(0)
    state = {k: v.to(torch.bfloat16) for k, v in state_of(Biased()).items()}
    ckpt = save_checkpoint(kind, state, tmp_path / "ckpt")
    real = _loaded(Biased, state)
    _quantize(real)
    with weights_from(ckpt, format="dcp" if kind == "dcp" else "auto") as weights:
        model = weights.model(Biased)
        _quantize(model)
        assert weights.quantized_keys == ["embed.weight", "up.weight", "down.weight"]
        for module in ("embed", "up", "down"):
            for inner in ("original0", "original1", "original2"):
                got = getattr(getattr(model, module).parametrizations.weight, inner)
                want = getattr(getattr(real, module).parametrizations.weight, inner)
                assert (got.dtype, got.shape) == (want.dtype, want.shape) and _file_backed(got)
                assert got.view(torch.uint8).equal(want.view(torch.uint8)) if got.element_size() == 1 else \
                    got.view(torch.int32).equal(want.view(torch.int32)), (module, inner)
        assert os.listdir(weights.convert_dir.folder) == []


def test_an_explicit_bind_takes_a_quantized_weight_kept_whole_as_bound_to_its_key(tmp_path):
    """Without ``unwrap_tensor_subclass`` (the CUDA backend's int4 keeps the tensor subclass),
    the program holds the quantized tensor itself: ``bind`` counts its key as used, not extra."""
    def make():
        return torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).eval()

    torch.manual_seed(0)
    ckpt = save_checkpoint("safetensors", state_of(make()), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        model = weights.model(make)
        quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)))
        program = torch.export.export(model, (torch.randn(2, 64),))
        (kept,) = program.state_dict.values()
        assert type(kept) is type(model[0].weight) and weights.quantized_keys == ["0.weight"]
        assert weights.bind(program) is program
        assert weights.owns(kept)


def test_quantize_twice_fails_inside_the_block_as_upstream_does(tmp_path):
    """A second quantize_ of the same linears meets torchao's quantized tensor, not a storage-less
    weight: torchao's own error, word for word, as on loaded weights (nothing read twice)."""
    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
    torch.manual_seed(0)
    weight = torch.randn(16, 64)
    ckpt = save_checkpoint("safetensors", {"0.weight": weight}, tmp_path / "ckpt")
    real = torch.nn.Sequential(torch.nn.Linear(64, 16, bias=False))
    real[0].weight = torch.nn.Parameter(weight.clone())
    quantize_(real, config)
    with pytest.raises(NotImplementedError) as upstream:
        quantize_(real, config)
    with weights_from(ckpt) as weights:
        model = weights.model(lambda: torch.nn.Sequential(torch.nn.Linear(64, 16, bias=False)))
        quantize_(model, config)
        with pytest.raises(NotImplementedError) as ours:
            quantize_(model, config)
        assert weights.quantized_keys == ["0.weight"]
    assert str(ours.value) == str(upstream.value)


def test_upstreams_references_to_finished_programs_are_dropped_and_the_bytes_are_upstreams(tmp_path):
    """A strict export (as optimum's) inside the context: dynamo's captured graph is not left in its
    module globals, and after emission neither ``is_same_node``'s cache nor XNNPACK's refusal log
    holds a node (hooks.program_caches); the .pte is executorch's own."""
    import torch._dynamo.functional_export as functional_export
    from executorch.backends.xnnpack.partition.config import xnnpack_config
    from executorch.exir.backend import utils as backend_utils

    torch.manual_seed(0)
    state = state_of(Biased())
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    real = _loaded(Biased, state)
    _quantize(real)
    want = _xnnpack(torch.export.export(real, TOKENS, strict=True)).buffer
    captured = [n for n in vars(functional_export) if n.startswith("__compiled_fn_")]
    assert captured  # upstream leaves the reference's captured graph there (torch 2.13)

    with weights_from(ckpt) as weights:
        with torch.device("meta"):
            model = Biased().eval()
        model = weights.model(model)
        _quantize(model)
        program = torch.export.export(model, TOKENS, strict=True)
        assert [n for n in vars(functional_export) if n.startswith("__compiled_fn_")] == captured
        manager = _xnnpack(program)
        assert backend_utils.is_same_node.cache_info().currsize == 0
        assert xnnpack_config.why.node is None
        (tmp_path / "out").mkdir()
        ptdstream.save(manager, str(tmp_path / "out" / "model.pte"))
    with open(tmp_path / "out" / "model.pte", "rb") as f:
        assert _sha(f.read()) == _sha(want)
