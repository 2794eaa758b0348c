"""Process lifetime helpers shared by the launcher and the ranks."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux), so nothing
    outlives the process that started it: a launcher killed outright still stops its children.
    """
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
