"""The training batches: deterministic, rank-sharded windows of a split's tokens, as tensors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class TokenLoader:
    """Deterministic rank-sharded batches of (input, target) windows.

    Sample ``i`` of the global stream starts at ``(i * stride) mod (N - seq_len - 1)`` with a
    stride coprime to the modulus, so windows are spread over the corpus. Each step consumes
    ``world_size * batch_size`` samples; rank ``r`` takes its contiguous slice. ``position`` (the
    next global sample index) is the loader's whole state and goes into every checkpoint.
    """

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    rank: int
    world_size: int
    position: int = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets) batch of this rank; advances the position."""
        span = len(self.tokens) - self.seq_len - 1
        stride = _coprime_stride(span, self.seq_len)
        first = self.position + self.rank * self.batch_size
        starts = [((first + b) * stride) % span for b in range(self.batch_size)]
        window = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        self.position += self.world_size * self.batch_size
        batch = torch.from_numpy(window)
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict:
        """The loader's position."""
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position saved by :meth:`state_dict`."""
        self.position = int(state["position"])


def _coprime_stride(span: int, seq_len: int) -> int:
    stride = seq_len * 7 + 1
    while np.gcd(stride, span) != 1:
        stride += 1
    return stride
