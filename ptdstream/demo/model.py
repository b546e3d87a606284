"""The small model ``ptdstream demo`` exports: a decoder-only transformer LM.

Written so that XNNPACK takes each method in two partitions (the transformer
body and the output projection) instead of a dozen: RMSNorm's mean is taken over
the two innermost dimensions of a 4-D view (XNNPACK lowers only that form of
``mean.dim``, as global average pooling), attention is spelled out with ``bmm`` +
``softmax`` + an additive causal-mask buffer, and the MLP uses ReLU. Fewer
partitions keep the export at about 15 s on two CPU cores.

The token embedding (``vocab_size x dim``) is the output projection's weight
(tied), so the exported program reads the same bytes twice: once as a program
constant (the ``embedding`` op stays on the portable kernels) and once as an
XNNPACK constant (the ``linear``). The demo shows they are stored once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["TinyLMConfig", "build_tiny_lm"]


@dataclass(frozen=True)
class TinyLMConfig:
    """Shape of :class:`TinyLM`; ``max_seq_len`` bounds the token count per call."""

    vocab_size: int = 512
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 256
    max_seq_len: int = 16
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension of a ``(batch, seq, dim)`` float tensor."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # mean over dims (2, 3) of a 4-D view: the only mean XNNPACK delegates.
        mean_square = (x * x).unsqueeze(-1).mean((2, 3), keepdim=True)
        mean_square = mean_square.view(x.shape[:-1] + (1,))
        return x * torch.rsqrt(mean_square + self.eps) * self.weight


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head attention, then a ReLU MLP."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        d = config.dim
        self.n_heads = config.n_heads
        self.attention_norm = RMSNorm(d, config.norm_eps)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.ffn_norm = RMSNorm(d, config.norm_eps)
        self.w1 = nn.Linear(d, config.hidden_dim)
        self.w2 = nn.Linear(config.hidden_dim, d)
        mask = torch.full((config.max_seq_len, config.max_seq_len), -1e9).triu(1)
        self.causal_mask: torch.Tensor
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        heads, head_dim = self.n_heads, dim // self.n_heads
        h = self.attention_norm(x)

        def split(t: torch.Tensor) -> torch.Tensor:
            # (batch, seq, dim) -> (batch * heads, seq, head_dim)
            t = t.view(batch, seq, heads, head_dim).transpose(1, 2)
            return t.reshape(batch * heads, seq, head_dim)

        q, k, v = split(self.wq(h)), split(self.wk(h)), split(self.wv(h))
        scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(head_dim))
        scores = scores + self.causal_mask[:seq, :seq]
        attn = torch.bmm(torch.softmax(scores, dim=-1), v)
        attn = attn.view(batch, heads, seq, head_dim).transpose(1, 2).reshape(batch, seq, dim)
        x = x + self.wo(attn)
        return x + self.w2(torch.relu(self.w1(self.ffn_norm(x))))


class TinyLM(nn.Module):
    """Token ids ``(batch, seq)`` int64 -> logits ``(batch, seq, vocab_size)`` float32.

    ``output.weight`` is ``tok_embeddings.weight`` (one ``Parameter``).
    """

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings = nn.Parameter(torch.randn(config.max_seq_len, config.dim) * 0.02)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens) + self.pos_embeddings[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build_tiny_lm(config: TinyLMConfig = TinyLMConfig(), seed: int = 0) -> TinyLM:
    """A :class:`TinyLM` in eval mode with weights drawn from ``seed``.

    Deterministic for a given torch build; the caller's global RNG state is left
    as it was (the draw happens inside ``torch.random.fork_rng``). CPU, float32.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyLM(config)
    return model.eval()
