"""A small GPT-style decoder used by the demo, the benchmarks and the tests.

Token + position embeddings, a ModuleList of pre-norm blocks (causal self-attention, MLP),
a final LayerNorm and an output head tied to the token embedding. Every module initializes
itself in ``reset_parameters()``, so the model can be built on the meta device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 256
    num_heads: int = 4
    num_layers: int = 4
    mlp_ratio: int = 4
    qkv_bias: bool = False
    """Off by default: the gradient of the key bias is exactly zero in exact arithmetic
    (softmax ignores a constant added to every key), so what autograd computes for it is
    rounding noise, which Adam normalizes into full-size steps. Any two implementations
    then disagree on those parameters; parity tests need them gone."""
    tie_embeddings: bool = True

    @property
    def num_params(self) -> int:
        """Parameters, a tied head counted once."""
        d, r = self.d_model, self.mlp_ratio
        block = (4 + 2 * r) * d * d + (r + 6) * d + (3 * d if self.qkv_bias else 0)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.seq_len * d + self.num_layers * block + 2 * d + head


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.num_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=cfg.qkv_bias)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        shape = (b, t, self.num_heads, d // self.num_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:  # the default: `offload plan --model offload.gpt:GPT`
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
