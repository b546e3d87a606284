"""The Llama model of ``bench_weightless.py --model llama``: its shape, its random
checkpoint written tensor by tensor (the model is never held), and how each
variant builds it.

The checkpoint is a Hugging Face folder (``config.json`` + ``model.safetensors``,
``save_pretrained``'s key names), so ``from_pretrained`` and optimum's
``main_export`` read it. Tensor ``i`` of the state dict is ``randn`` from seed
``i``, times 0.02, in the model's dtype; the file is written in one pass (header
from the shapes, then each tensor made, written and freed), so host memory is
one tensor at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct

GiB = 1 << 30
HEAD_DIM = 128
#: the shape family ``--gib`` scales (by layers): a Llama-2-like decoder, hidden 2048.
DEFAULT_SHAPE = {"hidden": 2048, "intermediate": 5632, "vocab": 32000}
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
DONE = ".complete"  # written last: a folder without it is rebuilt


def config(args):
    import transformers

    heads = max(1, args.hidden // HEAD_DIM)
    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max(args.seq, 128), tie_word_embeddings=False, dtype=args.dtype)


def layers_for(gib: float, args, itemsize: int) -> int:
    """Layers that bring the weights closest to ``gib`` GiB (at least 1)."""
    h, i, v = args.hidden, args.intermediate, args.vocab
    per_layer = 4 * h * h + 3 * h * i + 2 * h
    return max(1, round((gib * GiB / itemsize - 2 * v * h - h) / per_layer))


@contextlib.contextmanager
def default_dtype(name: str):
    import torch

    saved = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, name))
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build(args):
    """``LlamaForCausalLM`` of the config, in ``args.dtype``, eval mode (call it
    under ``torch.device("meta")`` or ``weights.model`` to hold no weight)."""
    import transformers

    with default_dtype(args.dtype):
        return transformers.LlamaForCausalLM(config(args)).eval()


def shapes(args) -> dict[str, tuple[int, ...]]:
    import torch

    with torch.device("meta"):
        model = build(args)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def folder_name(args) -> str:
    return f"llama-h{args.hidden}-i{args.intermediate}-v{args.vocab}-l{args.layers}-{args.dtype}"


def write_checkpoint(args, folder: str) -> int:
    """Write ``folder`` (config.json, model.safetensors) unless complete already;
    returns the weights' size in bytes."""
    import torch

    layout = shapes(args)
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    nbytes = sum(itemsize * _numel(s) for s in layout.values())
    if os.path.exists(os.path.join(folder, DONE)):
        return nbytes
    os.makedirs(folder, exist_ok=True)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape in layout.items():
        size = itemsize * _numel(shape)
        header[key] = {"dtype": SAFETENSORS_DTYPES[args.dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for i, shape in enumerate(layout.values()):
            g = torch.Generator().manual_seed(i)
            t = (torch.randn(shape, generator=g) * 0.02).to(getattr(torch, args.dtype)).contiguous()
            f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
            del t
        f.flush()
        os.fsync(f.fileno())
    config(args).save_pretrained(folder)
    with open(os.path.join(folder, DONE), "w") as f:
        f.write("ok\n")
    return nbytes


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Logits:
    """``torch.nn.Module`` factory: ``forward(input_ids) -> logits`` (no cache)."""

    @staticmethod
    def wrap(model):
        import torch

        class _Logits(torch.nn.Module):
            def __init__(self, inner) -> None:
                super().__init__()
                self.model = inner

            def forward(self, input_ids):
                return self.model(input_ids=input_ids, use_cache=False).logits

        return _Logits(model)


def key_map(model) -> dict[str, str]:
    """Exported FQN (``model.model.layers.0...``, the wrapper's) -> checkpoint key."""
    return {f"model.{k}": k for k in model.state_dict()}


def loaded(args, folder: str, mapped: bool):
    """The model with its weights: read into memory (``from_pretrained``'s way:
    empty model, tensors assigned) or, with ``mapped``, the file's mapped tensors."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = os.path.join(folder, "model.safetensors")
    with init_empty_weights():  # meta parameters, real buffers (inv_freq)
        model = build(args)
    if mapped:
        state = load_file(path)
    else:
        with safe_open(path, framework="pt") as f:
            state = {k: f.get_tensor(k).clone() for k in f.keys()}
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()
