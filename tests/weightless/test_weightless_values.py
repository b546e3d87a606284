"""weights_from where the export needs values: constant_prop_pass on bound programs
(each folded constant moved to a temp file as it is computed, the same bytes),
torchao quantization with a config not covered or outside the block (refused by name), and a Llama-style
decoder (prefill + decode sharing weights, tied embedding, real rotary inv_freq,
KV caches as mutable buffers, storage-less or real)."""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
from _checkpoints import save_checkpoint, state_of
from _llama import Llama, inv_freq, methods, seeded
from conftest import Mlp, example_inputs, read_folder
from torchao.quantization.quant_api import quantize_ as quantize_imported_early

import ptdstream
from ptdstream.upstream import adapter
from ptdstream.upstream.patching import is_shadowed
from ptdstream.weightless import (
    BindingError,
    QuantizationNeedsValuesError,
    UnboundConstantError,
    is_storage_less,
    weights_from,
)

warnings.filterwarnings("ignore")


def _config(**kwargs):
    from executorch.exir import ExecutorchBackendConfig

    return ExecutorchBackendConfig(external_constants=True, **kwargs)


def _lower(programs, **kwargs):
    from executorch.exir import to_edge

    return to_edge(programs).to_executorch(_config(**kwargs))


def _save(manager, folder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    ptdstream.save(manager, str(folder / "model.pte"))


def _seeded(cls):
    torch.manual_seed(0)
    return cls().eval()


def _mapped(tensor) -> bool:
    from ptdstream.system.pagecache import file_mapping

    return file_mapping(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()) is not None


# ------------------------------------------------------------------ constant_prop_pass


def test_const_prop_in_to_executorch_moves_folded_constants_to_files_and_saves_the_real_bytes(tmp_path,
                                                                                              monkeypatch):
    real = _seeded(Mlp)
    x = example_inputs(real)
    _save(_lower(torch.export.export(real, x), do_quant_fusion_and_const_prop=True), tmp_path / "real")
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    with weights_from(ckpt) as weights:
        manager = _lower(weights.export(weights.model(Mlp), x), do_quant_fusion_and_const_prop=True)
        program = manager.exported_program()
        folded = {k: v for k, v in program.constants.items() if k.startswith("_prop_tensor_constant")}
        assert sorted((k, tuple(v.shape)) for k, v in folded.items()) == [
            ("_prop_tensor_constant0", (32, 8)), ("_prop_tensor_constant1", (64, 32))]  # the transposes
        assert all(_mapped(v) for v in folded.values())  # not held in memory: mapped from a temp file
        assert torch.equal(folded["_prop_tensor_constant1"], real.l1.weight.detach().t())
        [folder] = os.listdir(temp)
        assert folder.startswith("ptdstream-convert-") and os.listdir(temp / folder) == []  # one folder, nameless files
        constants = adapter.manager_parts(manager).external_constant_buffer
        assert len(constants) == 4 and all(getattr(c, "file_mapped", False) for c in constants)
        _save(manager, tmp_path / "weightless")
    assert os.listdir(temp) == []  # the folder is removed with the context
    got = read_folder(str(tmp_path / "weightless"))
    assert sorted(got) == ["_default_external_constant.ptd", "model.pte"]
    assert got == read_folder(str(tmp_path / "real"))


class Scaled(torch.nn.Module):
    """A linear (its transpose folds from a bound weight) and a buffer product (folds from real tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(64, 64, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 64), persistent=False)

    def forward(self, x):
        return self.l(x) * (self.scale * 2.0)


def test_folded_from_real_tensors_only_stays_in_memory(tmp_path):
    from executorch.exir import to_edge
    from executorch.exir.passes.constant_prop_pass import constant_prop_pass

    real = _seeded(Scaled)
    x = (torch.randn(2, 64),)
    edge = to_edge(torch.export.export(real, x))
    constant_prop_pass(edge.exported_program())
    _save(edge.to_executorch(_config()), tmp_path / "real")
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        edge = to_edge(weights.export(weights.model(Scaled), x))
        constant_prop_pass(edge.exported_program())
        folded = {tuple(v.shape): v for k, v in edge.exported_program().constants.items()
                  if k.startswith("_prop_tensor_constant")}
        assert sorted(folded) == [(64,), (64, 64)]
        assert _mapped(folded[(64, 64)]) and not _mapped(folded[(64,)])
        assert torch.equal(folded[(64,)], real.scale * 2.0)
        _save(edge.to_executorch(_config()), tmp_path / "weightless")
    assert read_folder(str(tmp_path / "weightless")) == read_folder(str(tmp_path / "real"))


def test_constant_prop_patch_is_scoped_to_the_context(tmp_path):
    from executorch.exir.passes import constant_prop_pass as module

    # the pass fills the dict it gets through this module global: shadowing it reaches the pass
    assert "get_constant_placeholder_dict" in module.get_propagated_const_tensor_dict.__code__.co_names
    original = module.get_constant_placeholder_dict
    ckpt = save_checkpoint("safetensors", state_of(_seeded(Mlp)), tmp_path / "ckpt")
    with weights_from(ckpt):
        assert is_shadowed(module, "get_constant_placeholder_dict")
    assert module.get_constant_placeholder_dict is original and not is_shadowed(module, "get_constant_placeholder_dict")


def test_a_thread_outside_the_context_folds_in_memory_as_upstream(tmp_path):
    import threading

    from executorch.exir import to_edge
    from executorch.exir.passes.constant_prop_pass import constant_prop_pass

    real = _seeded(Mlp)
    x = example_inputs(real)
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        bound = to_edge(weights.export(weights.model(Mlp), x)).exported_program()
        results: list = []
        # another thread, in no context, folds the same bound weights: upstream's dict, nothing moved
        thread = threading.Thread(target=lambda: results.append(constant_prop_pass(bound)))
        thread.start()
        thread.join()
        [program] = results
        folded = [v for k, v in program.constants.items() if k.startswith("_prop_tensor_constant")]
        assert len(folded) == 2 and not any(_mapped(v) for v in folded)


def test_mapped_copy_keeps_layout_and_names_a_bad_folder(tmp_path):
    from ptdstream.weightless.mapped_copy import mapped_copy

    base = torch.arange(48, dtype=torch.float32)
    view = base[4:].view(4, 11)[:, 1:].t()  # offset, strides of a transposed slice
    copy = mapped_copy(view, str(tmp_path))
    assert torch.equal(copy, view) and copy.stride() == view.stride()
    assert copy.storage_offset() == view.storage_offset() and copy.untyped_storage().nbytes() == 192
    assert _mapped(copy) and os.listdir(tmp_path) == []
    with pytest.raises(OSError, match=f"temp folder {tmp_path / 'missing'}: cannot create a temp file there"):
        mapped_copy(view, str(tmp_path / "missing"))


# ------------------------------------------------------------------ quantization


def test_quantize_with_a_config_not_covered_is_refused_by_name_and_leaves_the_model(tmp_path):
    from torchao.quantization.quant_api import Int8WeightOnlyConfig

    ckpt = save_checkpoint("safetensors", state_of(_seeded(Mlp)), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        model = weights.model(Mlp)
        with pytest.raises(QuantizationNeedsValuesError) as caught:
            quantize_imported_early(model, Int8WeightOnlyConfig())  # imported before the context: seen too
        assert all(is_storage_less(p) for p in model.parameters())  # unchanged: still plain storage-less
        assert weights.quantized_keys == [] and os.listdir(weights.convert_dir.folder) == []
    assert caught.value.names == ["'l1.weight' (torch.float32 [32, 64])", "'l2.weight' (torch.float32 [8, 32])"]
    assert str(caught.value) == (
        "torchao quantize_ (Int8WeightOnlyConfig): 2 storage-less weight(s) would be quantized: 'l1.weight' "
        "(torch.float32 [32, 64]), 'l2.weight' (torch.float32 [8, 32]); Int8WeightOnlyConfig is not covered: "
        "weights_from quantizes storage-less weights as they stream with Int8DynamicActivationIntxWeightConfig and "
        "IntxWeightOnlyConfig (int4 or int8, PerGroup or PerAxis(0), symmetric, unpacked_to_int8, affine or "
        "hqq_scale_only) and Int4WeightOnlyConfig (tile_packed_to_4d): use one of them, or export this model with "
        "real weights (outside weights_from)")
    assert os.listdir(tmp_path) == ["ckpt"]


def test_quantize_in_a_thread_without_the_context_is_refused_by_name(tmp_path):
    import threading

    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig

    ckpt = save_checkpoint("safetensors", state_of(_seeded(Mlp)), tmp_path / "ckpt")
    caught = []
    with weights_from(ckpt) as weights:
        model = weights.model(Mlp)
        config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))

        def other():
            try:
                quantize_imported_early(model, config)
            except QuantizationNeedsValuesError as e:
                caught.append(e)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert all(is_storage_less(p) for p in model.parameters())
    assert str(caught[0]).endswith(
        "2 storage-less weight(s) would be quantized: 'l1.weight' (torch.float32 [32, 64]), 'l2.weight' "
        "(torch.float32 [8, 32]); quantization needs the weights' values: call torchao's quantize_ inside the "
        "weights_from block, in its thread (each weight is read from the checkpoint and quantized there), or "
        "export this model with real weights")


def test_quantized_constant_made_from_storage_less_weights_is_refused_by_bind(tmp_path):
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig

    real = _seeded(Mlp)
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        model = weights.model(Mlp)
        config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
        for linear in (model.l1, model.l2):  # torchao's handler called directly: no walk sees it
            adapter.quantize_handler(config)(linear, config)
        program = torch.export.export(model, example_inputs(real))
        with pytest.raises(BindingError) as caught:
            weights.bind(program)
    advice = ("quantization needs the weights' values: call torchao's quantize_ inside the weights_from block, in "
              "its thread (each weight is read from the checkpoint and quantized there), or export this model with "
              "real weights")
    assert caught.value.problems == [  # 'l1.weight' and 'l2.weight' are not reported as extra keys
        f"quantized: '{k}' is a IntxUnpackedToInt8Tensor made from a storage-less weight (its inner tensors hold "
        f"no bytes); {advice}" for k in ("l1.weight", "l2.weight")]
    assert is_storage_less(program.state_dict["l1.bias"])  # nothing bound
    assert os.listdir(tmp_path) == ["ckpt"]


# ------------------------------------------------------------------ a Llama-style decoder


def _exported(model, names=("prefill", "decode")):
    with torch.no_grad():
        return {m: torch.export.export(model, methods()[m]) for m in names}


def _llama_checkpoint(real, folder):
    """Weights only: the KV caches are not in the checkpoint (the tied head is stored once)."""
    return save_checkpoint("safetensors", {k: v for k, v in state_of(real).items() if "cache" not in k}, folder)


def _storage_less_caches_model(layers: int = 2):
    """Built on the meta device (parameters and KV caches storage-less), ``inv_freq`` assigned real."""
    with torch.device("meta"):
        model = Llama(layers)
    model.inv_freq = inv_freq()
    return model


def test_llama_prefill_and_decode_bound_together_save_the_real_exports_bytes(tmp_path):
    real = seeded()
    _save(_lower(_exported(real)), tmp_path / "real")
    ckpt = _llama_checkpoint(real, tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        model = weights.model(_storage_less_caches_model())
        assert not is_storage_less(model.inv_freq) and is_storage_less(model.layers[0].k_cache)
        programs = weights.bind(_exported(model))
        prefill, decode = programs["prefill"].state_dict, programs["decode"].state_dict
        assert prefill["lm_head.weight"] is prefill["embed.weight"] is decode["embed.weight"]  # bound once
        assert not is_storage_less(prefill["embed.weight"])
        assert is_storage_less(prefill["layers.0.k_cache"])  # a KV cache needs no checkpoint key
        _save(_lower(programs), tmp_path / "weightless")
    got = read_folder(str(tmp_path / "weightless"))
    assert sorted(got) == ["_default_external_constant.ptd", "model.pte"]
    assert got == read_folder(str(tmp_path / "real"))


@pytest.mark.parametrize("band", [None, 64, 10_000])
def test_llama_with_const_prop_saves_the_real_exports_bytes(tmp_path, monkeypatch, band):
    """Each folded transpose of a bound weight is moved to a file: whole (mapped_copy)
    up to BAND_NBYTES, above it written in bands (mapped_transpose, never computed in
    memory); the same constants, the same saved bytes as the real-weights export. With
    ``band`` None the default band is larger than every weight here."""
    from ptdstream.weightless import folding, mapped_copy

    calls = []
    real_transpose = mapped_copy.mapped_transpose

    def counted(tensor, folder, band_nbytes):
        calls.append((tuple(tensor.shape), band_nbytes))
        return real_transpose(tensor, folder, band_nbytes)

    if band is not None:
        monkeypatch.setattr(folding, "BAND_NBYTES", band)
    monkeypatch.setattr(folding, "mapped_transpose", counted)
    real = seeded()
    _save(_lower(_exported(real, ["decode"]), do_quant_fusion_and_const_prop=True), tmp_path / "real")
    ckpt = _llama_checkpoint(real, tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        programs = weights.bind(_exported(weights.model(_storage_less_caches_model()), ["decode"]))
        manager = _lower(programs, do_quant_fusion_and_const_prop=True)
        folded = [v for k, v in manager.exported_program("decode").constants.items()
                  if k.startswith("_prop_tensor_constant")]
        moved = [v for v in folded if _mapped(v)]
        assert len(moved) == 15  # 7 linears x 2 layers + the tied head, transposed
        assert all(v.numel() <= 64 for v in folded if not _mapped(v))  # folded from real tensors only
        banded = sorted((v.shape[1], v.shape[0]) for v in moved
                        if v.numel() * v.element_size() > folding.BAND_NBYTES)
        _save(manager, tmp_path / "weightless")
    # at 10,000 bytes the four 32x64 fp32 transposes are copied whole
    assert len(banded) == {None: 0, 64: 15, 10_000: 11}[band]
    assert sorted(shape for shape, _ in calls) == banded and all(b == folding.BAND_NBYTES for _, b in calls)
    assert read_folder(str(tmp_path / "weightless")) == read_folder(str(tmp_path / "real"))


def _xnnpack_tagged(programs):
    """Each program's weights tagged into ``w.ptd`` (``delegate_external_constants_pass_unlifted``), re-exported."""
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

    out = {}
    with torch.no_grad():
        for m, program in programs.items():
            unlifted = program.module()
            delegate_external_constants_pass_unlifted(unlifted, gen_tag_fn=lambda node: "w")
            out[m] = torch.export.export(unlifted, methods()[m], strict=False)
    return out


def _lower_xnnpack(programs):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    return to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()]).to_executorch(
        ExecutorchBackendConfig())


def test_llama_xnnpack_tagged_weights_with_storage_less_caches_save_the_real_exports_bytes(tmp_path):
    real = seeded(layers=1)  # one layer: XNNPACK's lowering is the slow part
    _save(_lower_xnnpack(_xnnpack_tagged(_exported(real, ["decode"]))), tmp_path / "real")
    ckpt = _llama_checkpoint(real, tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        programs = _xnnpack_tagged(_exported(weights.model(_storage_less_caches_model(layers=1)), ["decode"]))
        weights.bind(programs)
        assert is_storage_less(programs["decode"].state_dict["layers.0.v_cache"])
        manager = _lower_xnnpack(programs)
        blobs = adapter.manager_parts(manager).named_data.buffers
        assert blobs and all(getattr(b, "file_mapped", False) for b in blobs)  # XNNPACK kept references
        _save(manager, tmp_path / "weightless")
    got = read_folder(str(tmp_path / "weightless"))
    assert sorted(got) == ["model.pte", "w.ptd"]
    assert got == read_folder(str(tmp_path / "real"))


def test_initialized_storage_less_cache_is_refused_by_name_before_emission(tmp_path):
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    ckpt = _llama_checkpoint(seeded(), tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    with weights_from(ckpt) as weights:
        model = weights.model(_storage_less_caches_model())
        program = weights.bind(_exported(model, ["decode"])["decode"])
        with pytest.raises(BindingError) as caught:  # emission binds what it can: the checkpoint has no cache
            _lower(program, passes=[InitializedMutableBufferPass(["layers_0_k_cache"])])
    note = ("(a mutable buffer marked et_init_buffer, by InitializedMutableBufferPass: its initial values are "
            "serialized; give it real values in the model, or a checkpoint key)")
    assert caught.value.problems == [f"missing: 'layers.0.k_cache' needs checkpoint key 'layers.0.k_cache', which "
                                     f"the checkpoint does not hold {note}"]
    assert os.listdir(out) == []
    program = _exported(model, ["decode"])["decode"]  # after the block: the emission check names it
    with pytest.raises(UnboundConstantError) as caught:
        _lower(program, passes=[InitializedMutableBufferPass(["layers_0_k_cache"])])
    assert f"forward: 'layers.0.k_cache' {note}" in caught.value.names


def test_storage_less_buffer_that_is_only_read_still_needs_a_key(tmp_path):
    class Offset(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(64, 64)
            self.register_buffer("offset", torch.zeros(64))

        def forward(self, x):
            return self.l(x) + self.offset

    state = {k: v for k, v in state_of(_seeded(Offset)).items() if k != "offset"}
    ckpt = save_checkpoint("safetensors", state, tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        with torch.device("meta"):
            meta = Offset()
        program = torch.export.export(weights.model(meta), (torch.randn(2, 64),))
        with pytest.raises(BindingError) as caught:
            weights.bind(program)
    assert caught.value.problems == [
        "missing: 'offset' needs checkpoint key 'offset', which the checkpoint does not hold"]


def test_mapped_transpose_equals_the_transpose_for_any_band(tmp_path):
    from ptdstream.weightless.mapped_copy import mapped_transpose

    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        for shape in ((7, 13), (64, 3), (1, 5), (33, 1)):
            for band in (1, 17, 100, 1 << 20):
                src = (torch.arange(shape[0] * shape[1]) % 251 - 125).reshape(shape).to(dtype)
                out = mapped_transpose(src, str(tmp_path), band)
                assert out.shape == (shape[1], shape[0]) and out.is_contiguous() and out.dtype == dtype
                assert torch.equal(out, src.t().contiguous()) and _mapped(out), (dtype, shape, band)
    with pytest.raises(ValueError, match=r"needs a non-empty 2-D contiguous CPU tensor, got cpu \(3, 2\) "
                                         r"with strides \(1, 3\)"):
        mapped_transpose(torch.zeros(2, 3).t(), str(tmp_path), 64)
