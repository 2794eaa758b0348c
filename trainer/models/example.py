"""An example of a team's own model for ``--model py:trainer.models.example:build``.

The factory returns any object with the :class:`~trainer.models.spec.ModelSpec` members: the
module, its FSDP units, its loss on a batch, its vocabulary and default sequence length. Here a
small causal decoder made of PyTorch's own ``nn.TransformerEncoderLayer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from trainer.models.spec import causal_lm_loss


class TinyDecoder(nn.Module):
    """Token embedding, learned positions, causal PyTorch encoder layers, a head."""

    def __init__(
        self, vocab_size: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, seq_len: int = 64
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next token at every position."""
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)


@dataclass
class TinyDecoderSpec:
    """The ModelSpec of :class:`TinyDecoder`."""

    module: TinyDecoder = field(default_factory=TinyDecoder)
    vocab_size: int = 256
    seq_len: int = 64

    def fsdp_units(self) -> list[nn.Module]:
        """Each encoder layer."""
        return list(self.module.layers)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy."""
        return causal_lm_loss(self.module(inputs), targets)


def build() -> TinyDecoderSpec:
    """The factory: called on every rank after ``torch.manual_seed(--seed)``."""
    return TinyDecoderSpec()
