"""Models: the built-in sizes, Hugging Face causal LMs and a team's own module, each behind the
:class:`ModelSpec` Protocol (docs/models.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.errors import ParameterError
from trainer.models.sizes import MODEL_SIZES, ModelSize, size_parameters

if TYPE_CHECKING:  # (importing this package must not import torch: the pipeline's definition reads it)
    from trainer.models.spec import ModelSpec

__all__ = [
    "MODEL_SIZES",
    "ModelInfo",
    "ModelSize",
    "build_model",
    "check_model",
    "check_model_name",
    "model_modules",
    "parameter_count",
]


def check_model_name(name: str) -> None:
    """Refuse a ``--model`` that is none of the three forms (without loading anything)."""
    if name in MODEL_SIZES or (name.startswith(("hf:", "py:")) and len(name) > 3):
        return
    raise ParameterError(
        "model", f"unknown model {name!r} (known: {', '.join(MODEL_SIZES)}, hf:PATH, py:package.module:factory)"
    )


def build_model(name: str, *, cache: Path | None = None, meta: bool = False) -> ModelSpec:
    """The model ``--model name`` gives, unsharded; seed torch first (its initialization draws).

    Args:
        name: a built-in size, ``hf:PATH`` or ``py:package.module:factory``.
        cache: where an ``s3://`` model is downloaded (a run's ``model_cache``).
        meta: for checks: an HF model's parameters on the meta device even without weights, and
            of an ``s3://`` model only the config read (its weights are checked as ranks read them).
    """
    check_model_name(name)
    if name in MODEL_SIZES:
        from trainer.models.builtin import BuiltinModel

        return BuiltinModel(MODEL_SIZES[name])
    if name.startswith("hf:"):
        from trainer.models.hf import HfModel

        return HfModel(name.removeprefix("hf:"), cache=cache, meta=meta)
    from trainer.models import custom

    return custom.build(name.removeprefix("py:"))


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the launcher checks before any worker starts."""

    vocab_size: int
    seq_len: int
    parameters: int


def check_model(name: str, *, cache: Path | None = None) -> ModelInfo:
    """Build ``name`` without memory for its parameters where it can, and check what can fail
    later: the path, the config, the weights' names and shapes, a ``py:`` factory.

    Raises:
        ParameterError: naming ``model``.
    """
    if name in MODEL_SIZES:  # its shape says it all, without torch (the launcher never imports it)
        size = MODEL_SIZES[name]
        return ModelInfo(size.vocab_size, size.seq_len, size_parameters(size))
    spec = build_model(name, cache=cache, meta=True)
    check = getattr(spec, "check_weights", None)
    if check is not None and getattr(spec, "weights", None):
        check()
    return ModelInfo(spec.vocab_size, spec.seq_len, sum(p.numel() for p in spec.module.parameters()))


def parameter_count(name: str) -> int:
    """Parameters of the model ``name`` (a built-in size's from its shape, others' built on the meta device)."""
    if name in MODEL_SIZES:
        return size_parameters(MODEL_SIZES[name])
    return check_model(name).parameters


def model_modules(name: str) -> list[str]:
    """What a rank imports to build ``--model name`` that a node's zygote can import once for all
    its ranks: for an ``hf:`` model, transformers' causal-LM classes and, for a local folder, the
    modeling module of its config's ``model_type``. Without torch or transformers, and without
    raising: a name or config it cannot read gives less (the rank imports the rest itself).
    Nothing for a ``py:`` model: a team's module may do anything when imported, such as take a
    GPU, which a process that forks ranks must not.
    """
    if not name.startswith("hf:"):
        return []
    modules = ["trainer.models.hf", "transformers.models.auto.modeling_auto"]
    try:
        model_type = json.loads((Path(name.removeprefix("hf:")) / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return modules  # not a local folder (a hub id, s3://), or no usable config
    if isinstance(model_type, str) and re.fullmatch(r"[a-z0-9_]+", model_type):
        modules.append(f"transformers.models.{model_type}.modeling_{model_type}")
    return modules
