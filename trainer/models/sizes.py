"""The built-in model's named sizes (no torch here: the pipeline's definition reads them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelSize:
    """Shape of one named model size."""

    dim: int
    layers: int
    heads: int
    seq_len: int
    vocab_size: int = 256  # the byte-level tokenizer's vocabulary


MODEL_SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(dim=64, layers=2, heads=4, seq_len=64),  # ~0.1M params: tests
    "small": ModelSize(dim=256, layers=4, heads=8, seq_len=128),  # ~3M: demo
    "base": ModelSize(dim=768, layers=12, heads=12, seq_len=256),  # ~85M
    "large": ModelSize(dim=1024, layers=24, heads=16, seq_len=512),  # ~300M
    "1b": ModelSize(dim=2048, layers=18, heads=16, seq_len=1024),  # ~0.9B: GPUs
}


def size_parameters(size: ModelSize) -> int:
    """Number of parameters of a model of this size (without building it)."""
    per_block = 12 * size.dim * size.dim + 4 * size.dim
    return size.layers * per_block + (2 * size.vocab_size + size.seq_len) * size.dim + 2 * size.dim
