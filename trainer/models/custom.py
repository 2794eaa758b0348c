"""A team's own module (``--model py:package.module:factory``).

``factory()`` is called with no arguments after the trainer seeded torch with ``--seed``, on every
rank, and returns a :class:`~trainer.models.spec.ModelSpec` (see ``trainer.models.example``).
"""

from __future__ import annotations

import importlib

from trainer.errors import ParameterError
from trainer.models.spec import ModelSpec

PREFIX = "py:"


def build(target: str) -> ModelSpec:
    """The spec ``target`` (``package.module:factory``) returns, checked against the Protocol.

    Raises:
        ParameterError: naming ``model`` for a malformed target, an import error, a missing
            factory or a result that is not a ModelSpec.
    """
    module_name, _, factory_name = target.partition(":")
    if not module_name or not factory_name.isidentifier():
        raise ParameterError("model", f"py:{target}: expected py:package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an import error in the team's code is theirs to see, by name
        raise ParameterError("model", f"py:{target}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ParameterError("model", f"py:{target}: {module_name} has no function {factory_name}")
    spec = factory()
    if not isinstance(spec, ModelSpec):
        raise ParameterError(
            "model", f"py:{target}: {factory_name}() returned a {type(spec).__name__}, not a ModelSpec (docs/models.md)"
        )
    if not spec.fsdp_units():
        raise ParameterError("model", f"py:{target}: its fsdp_units() is empty (at least one submodule to shard)")
    return spec
