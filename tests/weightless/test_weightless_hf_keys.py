"""Checkpoints as transformers reads them: its own key renaming and fusing (its
conversion mapping, run on stand-ins) bind a folder ``from_pretrained`` loads.
A transformers-saved Mixtral folder (``block_sparse_moe.experts.N.w1/w2/w3``;
the model holds fused ``mlp.experts.gate_up_proj`` / ``down_proj``) saves the
loaded export's bytes; where optimum cannot export it, the weightless route
fails as upstream does, with no output; BERT's legacy ``LayerNorm.gamma`` names
bind by their new names; what transformers itself cannot load is refused by
name, with a true hint."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import shutil
import warnings

import pytest
import torch

pytest.importorskip("optimum.exporters.executorch", reason="needs ptdstream[hf] (bash tools/setup.sh --hf)")

import transformers
from safetensors.torch import load_file, save_file

import ptdstream
import ptdstream.hf
from ptdstream.weightless import BindingError, model_from_config, pretrained_without_weights, storage_less_model

pytestmark = pytest.mark.hf
warnings.filterwarnings("ignore")
INDEX = "model.safetensors.index.json"
TOKENS = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))


class Logits(torch.nn.Module):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


class DenseExperts(torch.nn.Module):
    """Layer 0's experts on every token, mixed by its router: an exportable use of the fused tensors."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        mlp = self.model.model.layers[0].mlp
        weights = torch.softmax(torch.nn.functional.linear(x, mlp.gate.weight), -1)
        gate, up = torch.einsum("th,eih->tei", x, mlp.experts.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("tei,ehi->teh", torch.nn.functional.silu(gate) * up, mlp.experts.down_proj)
        return (out * weights[..., None]).sum(1)


def _sha256s(folder: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _portable(model, folder: str) -> dict[str, str]:
    from executorch.exir import ExecutorchBackendConfig, to_edge

    manager = to_edge(torch.export.export(DenseExperts(model), (TOKENS,))).to_executorch(
        ExecutorchBackendConfig(external_constants=True))
    os.makedirs(folder)
    ptdstream.save(manager, os.path.join(folder, "model.pte"))
    return _sha256s(folder)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny Mixtral saved by transformers in several shards, and the loaded export's files."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2)
    folder = str(tmp_path_factory.mktemp("mixtral") / "model")
    transformers.MixtralForCausalLM(config).save_pretrained(folder, max_shard_size="30KB")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return folder, _portable(loaded, str(tmp_path_factory.mktemp("real") / "o"))


def _keys(folder: str) -> list[str]:
    with open(os.path.join(folder, INDEX)) as f:
        return sorted(json.load(f)["weight_map"])


def test_mixtral_fused_experts_save_the_loaded_exports_bytes(mixtral, tmp_path):
    folder, want = mixtral
    keys = _keys(folder)
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in keys  # transformers saved the legacy names
    assert not any("gate_up_proj" in k or ".mlp." in k for k in keys)
    with pretrained_without_weights() as loaded:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        got = _portable(model, str(tmp_path / "o"))
        (weights,) = loaded.weights.values()
        assert loaded.bound == 1
        fused = [f"model.layers.{i}.mlp.experts.{name}" for i in (0, 1) for name in ("gate_up_proj", "down_proj")]
        assert sorted(weights.converted_keys) == sorted(fused)  # each copied once, piece by piece
        assert weights.checkpoint.entries[fused[0]].where == (
            "fused by transformers from 8 key(s) ('model.layers.0.block_sparse_moe.experts.0.w1.weight', "
            "'model.layers.0.block_sparse_moe.experts.0.w3.weight', "
            "'model.layers.0.block_sparse_moe.experts.1.w1.weight', ...)")
        assert "model.layers.0.block_sparse_moe.gate.weight" in weights.bound_keys  # renamed: .mlp.gate
    assert got == want


def test_model_from_config_in_weights_from_binds_fused_keys_through_any_wrapper(mixtral, tmp_path):
    folder, want = mixtral
    with ptdstream.weights_from(folder, allow_extra=True) as weights:
        got = _portable(model_from_config(folder).eval(), str(tmp_path / "o"))  # no key_map: keys recorded
        assert weights.programs_bound == 1
    assert got == want


def test_mixtral_through_optimum_fails_as_upstream_does_with_no_output(mixtral, tmp_path):
    folder, _ = mixtral
    failures = []
    for weightless in (False, True):
        out = tmp_path / f"out-{weightless}"
        with pytest.raises(Exception) as raised:  # upstream's own failure, whatever it is
            ptdstream.hf.export(folder, str(out), task="text-generation", recipe="portable", max_seq_len=16,
                                weightless=weightless, quiet=True)
        failures.append((type(raised.value), str(raised.value)))
        assert not out.exists() or os.listdir(out) == []
    assert "data-dependent" in failures[0][1]  # the experts' loop over the routed tokens
    assert failures[1] == failures[0]


def test_legacy_layernorm_names_bind_by_their_new_names(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)
    folder = str(tmp_path / "bert")
    transformers.BertForMaskedLM(config).save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in state.items()}
    assert sum(k.endswith("LayerNorm.gamma") for k in renamed) == 6  # embeddings, 2 per layer, the MLM head
    save_file(renamed, path, metadata={"format": "pt"})
    from executorch.exir import ExecutorchBackendConfig, to_edge

    ids = (torch.tensor([[2, 7, 1, 9, 4]]),)
    files = {}
    for weightless in (False, True):
        with pretrained_without_weights() if weightless else contextlib.nullcontext():
            model = transformers.AutoModelForMaskedLM.from_pretrained(folder).eval()
            program = torch.export.export(Logits(model), ids)
            manager = to_edge(program).to_executorch(ExecutorchBackendConfig(external_constants=True))
            out = str(tmp_path / f"out-{weightless}")
            os.makedirs(out)
            ptdstream.save(manager, os.path.join(out, "model.pte"))
        files[weightless] = _sha256s(out)
    assert files[True] == files[False] and sorted(files[True]) == ["_default_external_constant.ptd", "model.pte"]


def test_a_fused_tensor_transformers_cannot_build_is_refused_by_name(mixtral, tmp_path):
    folder = str(shutil.copytree(mixtral[0], tmp_path / "model"))
    with open(os.path.join(folder, INDEX)) as f:
        index = json.load(f)
    key = "model.layers.0.block_sparse_moe.experts.3.w1.weight"
    shard = os.path.join(folder, index["weight_map"].pop(key))
    state = load_file(shard)
    del state[key]
    save_file(state, shard, metadata={"format": "pt"})
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump(index, f)
    with pytest.raises(RuntimeError, match="automatic conversion of the weights"):
        transformers.AutoModelForCausalLM.from_pretrained(folder)  # upstream refuses it too
    with pytest.raises(BindingError) as raised:
        with pretrained_without_weights():
            transformers.AutoModelForCausalLM.from_pretrained(folder)
    (problem,) = raised.value.problems
    assert problem.startswith("converting: the model's 'model.layers.0.mlp.experts.gate_up_proj': transformers "
                              "could not build it from the checkpoint: Sizes of tensors must match")
    assert problem.endswith("(from_pretrained refuses it too)")


def test_a_conversion_that_reorders_elements_is_refused_by_name_with_what_to_do(tmp_path):
    """An operation the stand-ins cannot read in pieces (a transpose, here in a
    mapping given to from_pretrained's machinery): named, and the hint is not
    "from_pretrained refuses it" (it does not)."""
    from transformers.core_model_loading import ConversionOps, WeightConverter

    from ptdstream.weightless.hf_keys import record_keys

    class Transposed(ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            (tensors,) = input_dict.values()
            return {target_patterns[0]: tensors[0].t()}

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    folder = str(tmp_path / "llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    mapping = [WeightConverter("self_attn.q_proj.weight", "self_attn.q_proj.weight", operations=[Transposed()])]
    with ptdstream.weights_from(folder) as weights:
        model = storage_less_model(lambda: transformers.LlamaForCausalLM(config))
        with pytest.raises(BindingError) as raised:
            record_keys(model, weights, mapping)
    (problem,) = raised.value.problems
    assert problem.startswith("converting: the model's 'model.layers.0.self_attn.q_proj.weight': transformers "
                              "builds it from the checkpoint with an operation not read in pieces by the "
                              "weightless route: aten.t.default")
    assert problem.endswith(": export it with the weights loaded")
