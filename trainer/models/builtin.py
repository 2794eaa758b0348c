"""The built-in models: a small decoder-only transformer (GPT-style) over byte tokens, in five
named sizes (``--model tiny`` ... ``1b``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.sizes import MODEL_SIZES, ModelSize, size_parameters
from trainer.models.spec import causal_lm_loss

__all__ = ["MODEL_SIZES", "BuiltinModel", "ModelSize", "Transformer", "size_parameters"]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.heads = size.heads
        self.attn_norm = nn.LayerNorm(size.dim)
        self.qkv = nn.Linear(size.dim, 3 * size.dim, bias=False)
        self.proj = nn.Linear(size.dim, size.dim, bias=False)
        self.mlp_norm = nn.LayerNorm(size.dim)
        self.up = nn.Linear(size.dim, 4 * size.dim, bias=False)
        self.down = nn.Linear(4 * size.dim, size.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply attention and MLP with residual connections."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class Transformer(nn.Module):
    """Decoder-only language model over byte tokens."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.size = size
        self.embed = nn.Embedding(size.vocab_size, size.dim)
        self.pos = nn.Embedding(size.seq_len, size.dim)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.dim)
        self.head = nn.Linear(size.dim, size.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init; residual projections scaled down by depth."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            std = 0.02 / math.sqrt(2 * self.size.layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Returns the mean next-token cross-entropy loss."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return causal_lm_loss(self.head(self.norm(x)), targets)


class BuiltinModel:
    """A built-in size as a :class:`~trainer.models.spec.ModelSpec`: sharded per block."""

    def __init__(self, size: ModelSize) -> None:
        self.module = Transformer(size)
        self.vocab_size, self.seq_len = size.vocab_size, size.seq_len

    def fsdp_units(self) -> list[nn.Module]:
        """Each transformer block."""
        return list(self.module.blocks)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's own loss (its forward takes the targets)."""
        return self.module(inputs, targets)
