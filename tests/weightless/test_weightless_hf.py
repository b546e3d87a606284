"""Hugging Face without loading the model: a storage-less model from ``config.json``
(``model_from_config``, accelerate's ``init_empty_weights``, or ``from_pretrained``
inside ``pretrained_without_weights``), bound to the folder's safetensors shards,
saves the same bytes as the export on loaded weights; what cannot be bound or needs
the weights' values is refused by name with nothing written."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import warnings

import pytest
import torch

pytest.importorskip("optimum.exporters.executorch", reason="needs ptdstream[hf] (bash tools/setup.sh --hf)")

import transformers
from conftest import read_folder
from safetensors.torch import load_file, save_file

import ptdstream
import ptdstream.hf
from ptdstream.upstream import adapter
from ptdstream.upstream.patching import is_shadowed
from ptdstream.weightless import BindingError, is_storage_less, weights_from
from ptdstream.weightless.errors import NeedsWeightValuesError
from ptdstream.weightless.hf import model_from_config, pretrained_without_weights

pytestmark = pytest.mark.hf
warnings.filterwarnings("ignore")


def _config(tied: bool = True, layers: int = 1):
    return transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tied,
    )


def _folder(path, config, dtype=torch.float32) -> str:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(str(path))
    return str(path)


class Logits(torch.nn.Module):
    """``model(input_ids).logits``: a plain forward for torch.export."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


TOKENS = (torch.tensor([[3, 17, 42, 99, 5]], dtype=torch.long),)


def _portable(program, folder) -> dict[str, bytes]:
    from executorch.exir import ExecutorchBackendConfig, to_edge

    manager = to_edge(program).to_executorch(ExecutorchBackendConfig(external_constants=True))
    os.makedirs(folder)
    ptdstream.save(manager, os.path.join(folder, "model.pte"))
    return read_folder(str(folder))


def _shadows() -> list[bool]:
    model_class = adapter.pretrained_model_class()
    return [is_shadowed(model_class, "_load_pretrained_model"), is_shadowed(torch.nn.Module, "to"),
            is_shadowed(torch.export.ExportedProgram, "run_decompositions")]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tied 1-layer Llama folder and the files of its export on loaded weights."""
    folder = _folder(tmp_path_factory.mktemp("llama"), _config())
    loaded = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    files = _portable(torch.export.export(Logits(loaded), TOKENS), str(tmp_path_factory.mktemp("real") / "o"))
    return folder, loaded, files


@pytest.mark.parametrize("build", ["model_from_config", "init_empty_weights"])
def test_storage_less_model_from_config_saves_the_loaded_exports_bytes(llama, tmp_path, build):
    folder, loaded, want = llama
    with weights_from(folder, allow_extra=True) as weights:
        if build == "model_from_config":
            model = model_from_config(folder)
        else:
            from accelerate import init_empty_weights

            with init_empty_weights():  # meta parameters, real buffers: taken as they are
                model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
            model.tie_weights()  # accelerate's register_parameter unties them: its docs tie after the block
            model = weights.model(model)
        params = dict(model.named_parameters(remove_duplicate=False))
        assert all(is_storage_less(p) for p in params.values())
        assert params["lm_head.weight"] is params["model.embed_tokens.weight"]  # tied: one tensor
        inv_freq = model.model.rotary_emb.inv_freq
        assert not is_storage_less(inv_freq) and torch.equal(inv_freq, loaded.model.rotary_emb.inv_freq)
        # FQNs are 'model.model.layers.0...' (the wrapper's), keys 'model.layers.0...'
        key_map = {f"model.{k}": k for k in params}
        program = weights.bind(torch.export.export(Logits(model.eval()), TOKENS), key_map=key_map)
        got = _portable(program, str(tmp_path / "o"))
    assert got == want


def test_from_pretrained_inside_reads_no_weight_and_restores(llama):
    folder, loaded, _ = llama
    assert _shadows() == [False, False, False]
    with pretrained_without_weights() as ctx:
        assert _shadows() == [True, True, True]
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        params = dict(model.named_parameters(remove_duplicate=False))
        assert sorted(params) == sorted(dict(loaded.named_parameters(remove_duplicate=False)))
        assert all(is_storage_less(p) for p in params.values())
        assert params["lm_head.weight"] is params["model.embed_tokens.weight"]
        assert torch.equal(model.model.rotary_emb.inv_freq, loaded.model.rotary_emb.inv_freq)
        assert model.to("cpu") is model and model.to(torch.float32) is model
        wrapper = Logits(model)  # optimum moves its own wrappers too (Whisper's encoder)
        assert wrapper.to("cpu") is wrapper and wrapper.to(device="cpu", dtype=torch.float32) is wrapper
        with pytest.raises(NeedsWeightValuesError, match=r"LlamaForCausalLM\.to\(cpu, torch\.bfloat16\)"):
            model.to(torch.bfloat16)
        program = torch.export.export(Logits(model), TOKENS)
        assert ctx.bound == 0 and all(is_storage_less(t) for t in program.state_dict.values())
        again = torch.export.export(program.module(), TOKENS)  # optimum re-exports program.module()
        assert all(is_storage_less(t) for t in again.state_dict.values())
        from executorch.exir import to_edge

        to_edge(again)  # bound as it reaches lowering (its first run_decompositions)
        assert ctx.bound == 1 and list(ctx.weights) == [os.path.abspath(folder)]
        state = again.state_dict
        assert not any(is_storage_less(t) for t in state.values())
        mapped = ctx.weights[os.path.abspath(folder)].checkpoint._tensors
        assert state["model.lm_head.weight"] is state["model.model.embed_tokens.weight"]
        assert state["model.model.embed_tokens.weight"].data_ptr() == mapped["model.embed_tokens.weight"].data_ptr()
    assert _shadows() == [False, False, False]
    again = transformers.AutoModelForCausalLM.from_pretrained(folder)  # loads as usual again
    assert torch.equal(again.model.norm.weight, loaded.model.norm.weight)


class _BufConfig(transformers.PretrainedConfig):
    model_type = "ptdstream-buffers"


class _BufModel(transformers.PreTrainedModel):
    """A linear and two persistent buffers (``scale``, ``offset``): both saved by ``save_pretrained``."""

    config_class = _BufConfig

    def __init__(self, config) -> None:
        super().__init__(config)
        self.l = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(4, dtype=torch.float32))
        self.register_buffer("offset", torch.full((4,), 7.0))
        self.post_init()

    def forward(self, x):
        return self.l(x) * self.scale + self.offset


def test_persistent_buffers_bound_when_the_checkpoint_holds_them_else_kept(tmp_path):
    """A persistent buffer the shards hold is bound (its value is the checkpoint's, as when
    loaded); one they lack keeps the value its module computed, as from_pretrained keeps it."""
    torch.manual_seed(0)
    model = _BufModel(_BufConfig())
    model.scale.mul_(3)  # the checkpoint's value differs from the constructor's
    model.save_pretrained(str(tmp_path))
    path = os.path.join(tmp_path, "model.safetensors")
    state = load_file(path)
    del state["offset"]
    save_file(state, path, metadata={"format": "pt"})
    want = _BufModel.from_pretrained(str(tmp_path))
    x = (torch.ones(1, 4),)
    real = _portable(torch.export.export(want, x), str(tmp_path / "real"))
    with pretrained_without_weights():
        light = _BufModel.from_pretrained(str(tmp_path))
        assert is_storage_less(light.scale) and is_storage_less(light.l.weight)
        assert not is_storage_less(light.offset) and torch.equal(light.offset, torch.full((4,), 7.0))
        got = _portable(torch.export.export(light, x), str(tmp_path / "light"))  # bound in to_edge
    assert got == real


def test_missing_and_mistyped_weights_refused_by_name_before_any_output(tmp_path):
    folder = _folder(tmp_path / "m", _config(tied=False))
    state = load_file(os.path.join(folder, "model.safetensors"))
    del state["model.norm.weight"]
    state["lm_head.weight"] = state["lm_head.weight"].to(torch.float64)  # bfloat16 would be converted
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    before = read_folder(folder)
    out = tmp_path / "out"
    with pytest.raises(BindingError) as info:
        ptdstream.hf.export(folder, str(out), task="text-generation", recipe="portable", weightless=True,
                            max_seq_len=16)
    problems = info.value.problems
    assert len(problems) == 2, problems
    assert problems[0] == ("missing: the model's 'model.norm.weight' (torch.float32 [32]) is not in the checkpoint, "
                           "under its name or any name transformers converts to it (from_pretrained would initialize "
                           "it at random)")
    assert problems[1].startswith("'lm_head.weight' (")
    assert problems[1].endswith("the checkpoint holds torch.float64 [128, 32], the model needs torch.float32 "
                                "[128, 32]")
    assert not out.exists() and read_folder(folder) == before
    assert _shadows() == [False, False, False]


def test_quantization_not_covered_refused_by_name_api_and_cli(llama, tmp_path, capsys):
    folder, _, _ = llama
    out = tmp_path / "out"
    with pytest.raises(NeedsWeightValuesError, match=r": qlinear='fpa4w': weightless=True quantizes each weight as "
                                                     r"it is read only with qlinear 8da4w, 8da8w, 4w, 8w;"):
        ptdstream.hf.export(folder, str(out), task="text-generation", weightless=True, qlinear="fpa4w")
    rc = ptdstream.hf.main(["export", "executorch", "-m", folder, "--task", "text-generation", "--recipe",
                            "xnnpack", "-o", str(out), "--qembedding", "8w", "--qlinear", "fpa4w", "--weightless"])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.strip() == (f"ptdstream.hf: error: {folder}: --qlinear 'fpa4w': --weightless quantizes each weight as "
                           "it is read only with qlinear 8da4w, 8da8w, 4w, 8w; qlinear_encoder 8da4w, 8da8w, 4w, 8w; "
                           "qembedding 8w, 4w; qembedding_encoder 8w, 4w; use one of them, or export without "
                           "--weightless")
    assert not out.exists()
    assert _shadows() == [False, False, False]


@pytest.mark.parametrize("flags, named", [(["--qlinear_encoder", "fpa4w"], "--qlinear_encoder 'fpa4w'"),
                                          (["--qlinear=8da4w,fpa4w"], "--qlinear '8da4w,fpa4w'"),
                                          (["--qlinear", "fpa4w", "--qlinear_encoder", "fpa4w"],
                                           "--qlinear 'fpa4w', --qlinear_encoder 'fpa4w'")],
                         ids=["qlinear_encoder", "qlinear=", "two"])
def test_the_cli_refuses_every_quantization_value_the_api_refuses(llama, tmp_path, capsys, flags, named):
    """One list (ptdstream.hf.routes.WEIGHTLESS_QUANTIZATION) for the API and the command line, checked
    before optimum runs; every entry of a comma-separated value."""
    folder, _, _ = llama
    out = tmp_path / "out"
    rc = ptdstream.hf.main(["export", "executorch", "-m", folder, "--task", "text-generation", "--recipe",
                            "portable", "-o", str(out), "--weightless", *flags])
    assert rc == 1
    assert capsys.readouterr().err.strip().startswith(
        f"ptdstream.hf: error: {folder}: {named}: --weightless quantizes each weight as it is read only with ")
    assert not out.exists()


def _real_and_weightless(folder, tmp_path, task, recipe, cli: bool, **options):
    real, light = str(tmp_path / "real"), str(tmp_path / "weightless")
    ptdstream.hf.export(folder, real, task=task, recipe=recipe, **options)
    if cli:
        flags = [x for k, v in options.items() for x in (f"--{k}", str(v))]
        assert ptdstream.hf.main(["export", "executorch", "-m", folder, "--task", task, "--recipe", recipe,
                                  "-o", light, "--weightless", *flags]) == 0
    else:
        ptdstream.hf.export(folder, light, task=task, recipe=recipe, weightless=True, **options)
    return read_folder(real), read_folder(light)


@pytest.mark.slow
def test_optimum_main_export_weightless_is_byte_identical_tied_llama_xnnpack(llama, tmp_path):
    folder, _, _ = llama
    real, light = _real_and_weightless(folder, tmp_path, "text-generation", "xnnpack", False, max_seq_len=16)
    assert sorted(light) == ["model.pte"] and light == real


@pytest.mark.slow
def test_optimum_cli_weightless_is_byte_identical_tied_llama_portable(llama, tmp_path):
    folder, _, _ = llama
    real, light = _real_and_weightless(folder, tmp_path, "text-generation", "portable", True, max_seq_len=16)
    assert sorted(light) == ["model.pte"] and light == real


@pytest.mark.slow
def test_optimum_cli_weightless_converts_a_bf16_folder_with_fp32_norms_as_from_pretrained_does(tmp_path):
    """A fine-tune's mixed dtypes (norms float32, the rest bfloat16) exported in optimum's default
    float32: each weight converted as it is read, the loaded export's bytes (issue 34: it was refused)."""
    folder = _folder(tmp_path / "m", _config(tied=False), dtype=torch.bfloat16)
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    state = {k: v.float() if "norm" in k else v for k, v in state.items()}
    save_file(state, path, metadata={"format": "pt"})
    assert {v.dtype for k, v in load_file(path).items() if "norm" in k} == {torch.float32}
    assert load_file(path)["lm_head.weight"].dtype == torch.bfloat16
    real, light = _real_and_weightless(folder, tmp_path, "text-generation", "portable", True, max_seq_len=16)
    assert sorted(light) == ["model.pte"] and light == real
