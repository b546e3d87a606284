"""optimum-executorch's quantized export (--qlinear 8da4w --qembedding 8w, XNNPACK) of a
Hugging Face folder without loading it: each weight read from the shards and quantized
as it streams; every file's sha256 equals upstream's own export (optimum's main_export,
executorch's serializer, no ptdstream) of the same folder in the same process."""

from __future__ import annotations

import hashlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import warnings

import pytest
import torch

pytest.importorskip("optimum.exporters.executorch", reason="needs ptdstream[hf] (bash tools/setup.sh --hf)")

import transformers

import ptdstream.hf

pytestmark = [pytest.mark.hf, pytest.mark.slow]
warnings.filterwarnings("ignore")

OPTIONS = {"task": "text-generation", "recipe": "xnnpack", "qlinear": "8da4w", "qembedding": "8w", "max_seq_len": 16}


def _folder(path, tied: bool, dtype, shard: str = "5GB") -> str:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(dtype).eval().save_pretrained(str(path), max_shard_size=shard)
    return str(path)


def _sha256(folder) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _upstream(folder, out) -> dict[str, str]:
    from optimum.exporters.executorch import main_export

    main_export(folder, output_dir=str(out), **OPTIONS)
    return _sha256(out)


def test_main_export_weightless_quantized_tied_bf16_checkpoint_is_upstreams_sha256(tmp_path):
    """A bf16 checkpoint exported in float32 (optimum's default dtype: from_pretrained converts), tied
    embedding: embed_tokens (8w) quantized first unties lm_head (8da4w), as upstream does."""
    folder = _folder(tmp_path / "m", tied=True, dtype=torch.bfloat16)
    want = _upstream(folder, tmp_path / "upstream")
    ptdstream.hf.export(folder, str(tmp_path / "weightless"), weightless=True, **OPTIONS)
    assert sorted(want) == ["model.pte"] and _sha256(tmp_path / "weightless") == want


def test_cli_weightless_quantized_untied_sharded_folder_is_upstreams_sha256(tmp_path):
    folder = _folder(tmp_path / "m", tied=False, dtype=torch.float32, shard="60KB")
    assert "model.safetensors.index.json" in os.listdir(folder)
    want = _upstream(folder, tmp_path / "upstream")
    flags = [x for k, v in OPTIONS.items() for x in (f"--{k}", str(v))]
    assert ptdstream.hf.main(["export", "executorch", "-m", folder, "-o", str(tmp_path / "weightless"),
                              "--weightless", "-q", *flags]) == 0
    assert sorted(want) == ["model.pte"] and _sha256(tmp_path / "weightless") == want
