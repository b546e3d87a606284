"""Hugging Face models through optimum-executorch's own entry points, saved by ptdstream.

Each case builds a real architecture from its config with random weights
(no download: ``HF_HUB_OFFLINE=1``), ``save_pretrained`` s it as safetensors
into a temp folder and exports that folder with optimum-executorch 1.1.0
(``main_export`` or the ``optimum-cli export executorch`` command, in this
process) while ptdstream writes the files. Then, in the same process (the
export is not deterministic between processes), executorch 1.5.1's own
``write_to_file`` + ``write_tensor_data_to_file`` write the same managers into
another folder: every file must be byte-identical, and both sets must load in
the ExecuTorch runtime and give the same outputs (and the eager model's, for
the float models).

Needs ``ptdstream[hf]`` (``bash tools/setup.sh --hf``); skipped without it.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

pytest.importorskip("optimum.exporters.executorch", reason="needs ptdstream[hf] (bash tools/setup.sh --hf)")

import transformers
from conftest import read_folder

import ptdstream
from ptdstream.hf import saving as pt_optimum
from ptdstream.hooks import install as pt_install
from ptdstream.hooks.emitter import StorageReference
from ptdstream.upstream import adapter, patching

pytestmark = pytest.mark.hf

ATOL = 1e-4


# --- tiny random-weight models, saved as a Hugging Face folder --------------------------------


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def _qwen():
    config = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return transformers.Qwen3ForCausalLM(config)


def _bert():
    config = transformers.BertConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )
    return transformers.BertForMaskedLM(config)


def _vit():
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=10,
    )
    return transformers.ViTForImageClassification(config)


def _whisper():
    config = transformers.WhisperConfig(
        vocab_size=256, num_mel_bins=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, d_model=32,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=50, max_target_positions=32,
        decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )
    return transformers.WhisperForConditionalGeneration(config)


def _save_whisper_processor(folder: str) -> None:
    """optimum's Whisper export reads the input shape from the folder's processor:
    a 16-bin feature extractor of 1 s (100 frames = 2 x max_source_positions) and a
    256-token byte-level vocabulary without merges."""
    extractor = transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1)
    vocab = {(chr(33 + i) if i < 94 else chr(0x100 + i)): i for i in range(256)}
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    tokenizer = transformers.WhisperTokenizer(os.path.join(folder, "vocab.json"),
                                              os.path.join(folder, "merges.txt"))
    transformers.WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(folder)


BUILDERS = {"llama": _llama, "qwen": _qwen, "bert": _bert, "vit": _vit, "whisper": _whisper}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """``{name: (folder, eager model)}``, built lazily (seed 0), weights as safetensors."""
    made = {}

    def get(name: str):
        if name not in made:
            torch.manual_seed(0)
            model = BUILDERS[name]().eval()
            folder = str(tmp_path_factory.mktemp(f"hf-{name}"))
            model.save_pretrained(folder)
            if name == "whisper":
                _save_whisper_processor(folder)
            made[name] = (folder, model)
        return made[name]

    return get


# --- the same managers through upstream's writer ----------------------------------------------


def is_installed() -> bool:
    """Whether ptdstream's ``write_to_file`` is in place (``install()`` or ``installed()``)."""
    return patching.is_shadowed(adapter.manager_class(), "write_to_file")


def upstream_files(managers, folder: str):
    """What optimum's ``export_to_executorch`` writes, through executorch 1.5.1's
    own methods (ptdstream not installed)."""
    if is_installed():
        raise RuntimeError("ptdstream is still installed: this would not be upstream's writer")
    os.makedirs(folder)
    for name, manager in managers.items():
        with open(os.path.join(folder, f"{name}.pte"), "wb") as f:
            manager.write_to_file(f)
        manager.write_tensor_data_to_file(folder)
    return read_folder(folder)


@pytest.fixture
def routed_calls(monkeypatch):
    """Counts the calls that reached ptdstream's ``write_to_file`` / ``write_tensor_data_to_file``."""
    calls = {"write_to_file": 0, "write_tensor_data_to_file": 0}
    real_pte, real_ptd = pt_install._write_to_file, pt_install._write_tensor_data_to_file

    def pte(self, f):
        calls["write_to_file"] += 1
        return real_pte(self, f)

    def ptd(self, outdir):
        calls["write_tensor_data_to_file"] += 1
        return real_ptd(self, outdir)

    monkeypatch.setattr(pt_install, "_write_to_file", pte)
    monkeypatch.setattr(pt_install, "_write_tensor_data_to_file", ptd)
    assert not is_installed()
    yield calls
    assert not is_installed()


def run_method(pte_path: str, method: str, inputs):
    """Outputs of ``method`` in the ExecuTorch runtime (``executorch.runtime``)."""
    from executorch.kernels import quantized  # noqa: F401  (quantized_decomposed::* kernels, as optimum's runner loads them)
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte_path)
    return program.load_method(method).execute(list(inputs))


def check_same_outputs(out: str, ref: str, method: str, inputs, want=None):
    """The ptdstream files and upstream's give equal outputs; ``want`` (eager) within ATOL."""
    got = run_method(os.path.join(out, "model.pte"), method, inputs)
    got_ref = run_method(os.path.join(ref, "model.pte"), method, inputs)
    assert len(got) == len(got_ref)
    for a, b in zip(got, got_ref, strict=True):
        assert torch.equal(a, b)
    assert torch.isfinite(got[0]).all()
    if want is not None:
        assert got[0].shape == want.shape, (got[0].shape, want.shape)
        diff = float((got[0] - want).abs().max())
        assert diff <= ATOL, f"{method}: max |runtime - eager| = {diff}"
    return got


def _llm_inputs():
    tokens = torch.tensor([[3, 17, 42, 99, 5]], dtype=torch.long)
    return tokens, (tokens, torch.arange(tokens.shape[1], dtype=torch.long))


def _eager_logits(model, tokens, like):
    with torch.no_grad():
        logits = model(tokens).logits
    return logits if like.dim() == 3 else logits[:, -1, :]


# --- the cases --------------------------------------------------------------------------------


def test_llama_xnnpack_main_export_install_hook(hf_folders, routed_calls, tmp_path):
    """The documented one-line hook around ``main_export``: ``ptdstream.installed()``."""
    from optimum.exporters.executorch import main_export

    folder, model = hf_folders("llama")
    out, ref = str(tmp_path / "out"), str(tmp_path / "ref")
    with ptdstream.installed():
        managers = main_export(folder, task="text-generation", recipe="xnnpack", output_dir=out, max_seq_len=32)
    assert routed_calls == {"write_to_file": 1, "write_tensor_data_to_file": 1}
    recorded, config = adapter.recorded_backend_config(managers["model"])
    assert recorded and config.extract_delegate_segments is True
    files = read_folder(out)
    assert sorted(files) == ["model.pte"]  # the xnnpack recipe keeps every weight in the .pte
    assert files == upstream_files(managers, ref)
    tokens, inputs = _llm_inputs()
    got = run_method(os.path.join(out, "model.pte"), "forward", inputs)[0]
    check_same_outputs(out, ref, "forward", inputs, _eager_logits(model, tokens, got))


def test_llama_portable_constants_by_reference(hf_folders, routed_calls, tmp_path):
    """The portable recipe: weights go through the emitter, kept by reference."""
    folder, model = hf_folders("llama")
    out, ref = str(tmp_path / "out"), str(tmp_path / "ref")
    managers = pt_optimum.run_main_export(folder, out, task="text-generation", recipe="portable", max_seq_len=32)
    assert routed_calls == {"write_to_file": 1, "write_tensor_data_to_file": 1}
    constants = adapter.manager_parts(managers["model"]).program.constant_buffer
    by_ref = [c.storage for c in constants if isinstance(c.storage, StorageReference)]
    # every weight matrix of the model (the small norms are by reference too)
    assert sum(len(s) for s in by_ref) >= sum(p.numel() * 4 for p in model.parameters() if p.dim() == 2)
    files = read_folder(out)
    assert files == upstream_files(managers, ref)
    tokens, inputs = _llm_inputs()
    got = run_method(os.path.join(out, "model.pte"), "forward", inputs)[0]
    check_same_outputs(out, ref, "forward", inputs, _eager_logits(model, tokens, got))


def test_qwen_cli_quantized_custom_sdpa_kv_cache(hf_folders, routed_calls, tmp_path, monkeypatch):
    """``optimum-cli export executorch`` (in this process) with 8da4w linears, 8-bit
    embeddings, custom SDPA and custom KV cache."""
    import optimum.exporters.executorch.__main__ as optimum_main

    folder, _ = hf_folders("qwen")
    out, ref = str(tmp_path / "out"), str(tmp_path / "ref")
    captured = {}
    real = optimum_main.export_to_executorch

    def capture(**kwargs):
        captured.update(real(**kwargs))
        return captured

    monkeypatch.setattr(optimum_main, "export_to_executorch", capture)
    rc = pt_optimum.run_optimum_cli([
        "export", "executorch", "--model", folder, "--task", "text-generation", "--recipe", "xnnpack",
        "--output_dir", out, "--qlinear", "8da4w", "--qembedding", "8w",
        "--use_custom_sdpa", "--use_custom_kv_cache", "--max_seq_len", "32",
    ])
    assert rc == 0
    assert routed_calls == {"write_to_file": 1, "write_tensor_data_to_file": 1}
    graph = captured["model"].exported_program("forward").graph_module.graph
    targets = " ".join(str(n.target) for n in graph.nodes if n.op == "call_function")
    assert "custom_sdpa" in targets and "update_cache" in targets and "quantized" in targets
    files = read_folder(out)
    assert files == upstream_files(captured, ref)
    _, inputs = _llm_inputs()
    check_same_outputs(out, ref, "forward", inputs)  # quantized: no eager comparison


def test_bert_fill_mask_xnnpack(hf_folders, routed_calls, tmp_path):
    folder, model = hf_folders("bert")
    out, ref = str(tmp_path / "out"), str(tmp_path / "ref")
    managers = pt_optimum.run_main_export(folder, out, task="fill-mask")
    assert routed_calls == {"write_to_file": 1, "write_tensor_data_to_file": 1}
    # XNNPACK's fp32 weights went through by reference (keys and bytes as upstream's)
    named = adapter.manager_parts(managers["model"]).named_data.buffers
    assert sum(isinstance(b, StorageReference) for b in named) >= 2 * 6  # 6 linears per layer, 2 layers
    assert read_folder(out) == upstream_files(managers, ref)
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    check_same_outputs(out, ref, "forward", (ids, mask), want)


def test_vit_image_classification_cli(hf_folders, routed_calls, tmp_path, monkeypatch):
    import optimum.exporters.executorch.__main__ as optimum_main

    folder, model = hf_folders("vit")
    out, ref = str(tmp_path / "out"), str(tmp_path / "ref")
    captured = {}
    real = optimum_main.export_to_executorch
    monkeypatch.setattr(optimum_main, "export_to_executorch",
                        lambda **kw: captured.update(real(**kw)) or captured)
    pt_optimum.run_optimum_cli(["export", "executorch", "-m", folder, "--task", "image-classification",
                     "--recipe", "xnnpack", "-o", out])
    assert routed_calls == {"write_to_file": 1, "write_tensor_data_to_file": 1}
    assert read_folder(out) == upstream_files(captured, ref)
    pixels = torch.rand((1, 3, 32, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(pixel_values=pixels).logits
    check_same_outputs(out, ref, "forward", (pixels,), want)


def test_whisper_asr_quantized_decoder(hf_folders, routed_calls, tmp_path):
    """Encoder, decoder with a static cache and sampler: three methods in one .pte;
    the decoder's linears 8da4w."""
    folder, model = hf_folders("whisper")
    out, ref = str(tmp_path / "out"), str(tmp_path / "ref")
    managers = pt_optimum.run_main_export(folder, out, task="automatic-speech-recognition",
                                 qlinear="8da4w", max_seq_len=16)
    assert managers["model"].methods == {"encoder", "text_decoder", "sampler"}
    assert routed_calls == {"write_to_file": 1, "write_tensor_data_to_file": 1}
    assert read_folder(out) == upstream_files(managers, ref)
    features = torch.rand((1, 16, 100), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.model.encoder(features).last_hidden_state
    hidden = check_same_outputs(out, ref, "encoder", (features,), want)[0]
    step = (torch.tensor([[1]], dtype=torch.long), hidden, torch.tensor([0], dtype=torch.long))
    check_same_outputs(out, ref, "text_decoder", step)


def test_installed_before_stays_installed():
    """An install made by the caller survives ``saving_with_ptdstream``; its own is undone."""
    assert not is_installed()
    ptdstream.install()
    try:
        with pt_optimum.saving_with_ptdstream(by_reference=False):
            assert is_installed()
        assert is_installed()
    finally:
        ptdstream.uninstall()
    with pt_optimum.saving_with_ptdstream(by_reference=True):
        assert is_installed()
        assert patching.is_shadowed(adapter.xnnpack_node_visitor_module(), "bytes")
    assert not is_installed()
    assert not patching.is_shadowed(adapter.xnnpack_node_visitor_module(), "bytes")
