"""The error for a bad parameter: it names the parameter the way the caller's user wrote it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal


class ParameterError(ValueError):
    """A bad parameter value, refused before anything starts.

    ``field`` is the config field (``ckpt_every``). The message names it as a command-line flag
    (``--ckpt-every: ...``) or, raised again by :func:`as_pipeline_parameters`, as the pipeline
    parameter of the same name (``ckpt_every: ...``).
    """

    def __init__(self, field: str, problem: str, *, style: Literal["flag", "parameter"] = "flag") -> None:
        self.field = field
        self.problem = problem
        self.style = style
        name = "--" + field.replace("_", "-") if style == "flag" else field
        super().__init__(f"{name}: {problem}")


@contextlib.contextmanager
def as_pipeline_parameters() -> Iterator[None]:
    """Inside, a :class:`ParameterError` names its field as a pipeline parameter."""
    try:
        yield
    except ParameterError as e:
        if e.style == "parameter":
            raise
        raise ParameterError(e.field, e.problem, style="parameter") from None
