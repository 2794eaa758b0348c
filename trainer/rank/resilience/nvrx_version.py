"""The NVRx release whose internals this package was checked against, and the refusal of another
one whose internals moved (the async writer's and the step watch's checks share it).
"""

from __future__ import annotations

import importlib.metadata

from trainer.errors import NonTransientError

NVRX_CHECKED = "0.4.1"
"""The nvidia-resiliency-ext release whose internals this package was checked against."""


def refuse_moved_internals(what: str, changed: list[str], module: str) -> None:
    """Raise :class:`NonTransientError`, naming both versions, when ``changed`` (the internals
    ``what`` relies on that the installed NVRx lacks in the checked form) is not empty.
    """
    if not changed:
        return
    try:
        installed = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        installed = "(version unknown)"
    raise NonTransientError(  # no restart brings the internals back
        f"nvidia-resiliency-ext {installed} is not what {what} was checked against "
        f"({NVRX_CHECKED}): expected, not found: {'; '.join(changed)} ({module})"
    )
