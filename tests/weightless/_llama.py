"""A tiny Llama-style decoder for the weightless tests: tied embedding, RMSNorm,
rotary attention with a non-persistent ``inv_freq``, grouped-query attention, a
SwiGLU MLP and a KV cache per layer as persistent buffers the forward mutates
(``index_copy_`` at ``input_pos``). ``forward(tokens [1, S] int64, input_pos [S]
int64) -> logits [1, S, vocab]``; prefill and decode are the same module
exported with S = 8 and S = 1."""

from __future__ import annotations

import torch

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, HIDDEN, MAX_SEQ = 128, 64, 2, 4, 2, 128, 16
HEAD_DIM = DIM // HEADS


def inv_freq() -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))


class RMSNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(DIM))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _rotate(x, cos, sin):
    a, b = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(), RMSNorm()
        self.q = torch.nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.k = torch.nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.v = torch.nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.o = torch.nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.gate = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.up = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.down = torch.nn.Linear(HIDDEN, DIM, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, KV_HEADS, MAX_SEQ, HEAD_DIM))
        self.register_buffer("v_cache", torch.zeros(1, KV_HEADS, MAX_SEQ, HEAD_DIM))

    def forward(self, x, input_pos, cos, sin, mask):
        s = x.shape[1]
        h = self.attn_norm(x)
        q = _rotate(self.q(h).view(1, s, HEADS, HEAD_DIM).transpose(1, 2), cos, sin)
        k = _rotate(self.k(h).view(1, s, KV_HEADS, HEAD_DIM).transpose(1, 2), cos, sin)
        v = self.v(h).view(1, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        keys = self.k_cache.repeat_interleave(HEADS // KV_HEADS, dim=1)
        values = self.v_cache.repeat_interleave(HEADS // KV_HEADS, dim=1)
        att = torch.softmax((q @ keys.transpose(-1, -2)) / HEAD_DIM ** 0.5 + mask, dim=-1)
        x = x + self.o((att @ values).transpose(1, 2).reshape(1, s, DIM))
        h = self.mlp_norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class Llama(torch.nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))
        self.norm = RMSNorm()
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", inv_freq(), persistent=False)

    def forward(self, tokens, input_pos):
        freqs = input_pos[:, None].float() * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        positions = torch.arange(MAX_SEQ)
        mask = torch.where(positions[None, :] <= input_pos[:, None], 0.0, float("-inf"))
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, input_pos, cos, sin, mask)
        return self.lm_head(self.norm(x))


def methods() -> dict[str, tuple]:
    """Example inputs: prefill (8 tokens at 0..7) and decode (1 token at 8)."""
    return {"prefill": (torch.randint(0, VOCAB, (1, 8)), torch.arange(8)),
            "decode": (torch.randint(0, VOCAB, (1, 1)), torch.tensor([8]))}


def seeded(layers: int = LAYERS) -> Llama:
    torch.manual_seed(0)
    model = Llama(layers).eval()
    with torch.no_grad():  # norm weights not all ones: dedup must follow values
        for layer in model.layers:
            layer.attn_norm.weight.uniform_(0.5, 1.5)
    return model
