"""What the trainer needs from a model: the :class:`ModelSpec` Protocol.

A model is given as ``--model NAME``: one of the built-in sizes (``tiny`` ... ``1b``), ``hf:PATH``
(a Hugging Face causal LM) or ``py:package.module:factory`` (a team's own ``nn.Module``). Each
becomes a ModelSpec; the trainer shards, checkpoints, restarts and validates every one alike.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class ModelSpec(Protocol):
    """A model the trainer can shard and train (docs/models.md).

    ``module`` is built unsharded, on the CPU with its initialization, or on the meta device when
    :meth:`materialize` fills it after sharding. The trainer puts ``fully_shard`` on each of
    :meth:`fsdp_units` (in order), then on ``module`` itself (the root).
    """

    module: nn.Module
    vocab_size: int
    """Token ids the model accepts: the data's largest id must be below it."""
    seq_len: int
    """The default sequence length (``--seq-len 0``)."""

    def fsdp_units(self) -> list[nn.Module]:
        """The submodules sharded one by one, usually the decoder layers."""
        ...

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``inputs`` against ``targets`` (already shifted)."""
        ...


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (batch, seq, vocab) against ``targets`` (batch, seq), in fp32."""
    return nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
