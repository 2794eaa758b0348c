"""The command every replica runs: NVRx's ft_launcher, with the node's zygote forked from it.

Example (what ``trainer.launch.local.worker_command`` builds)::

    python -m trainer.launch.agent [ft_launcher flags] -m trainer.launch.worker [train flags]

It is ft_launcher itself (its ``main``, in this process: the agent whose pid the workers and the
zygote check), with two differences, both for the seconds each job's start and end cost:

- The zygote (``trainer.launch.zygote``) is forked once this process has imported torch, before
  ft_launcher starts anything (no thread yet): torch is imported once for both, and the zygote's
  other imports overlap ft_launcher's rendezvous. Otherwise the first worker starts it, after the
  rendezvous, and every rank waits for both imports in turn. A worker that finds it still
  importing waits for it (``trainer.launch.worker``); without one, a worker starts it as before.
- The process ends without the interpreter's teardown (:func:`trainer.process.leave`): with torch
  loaded, that teardown is seconds of CPU after the job is over.

And two for the seconds a recovery costs: the rendezvous's keep-alive (:func:`shorten_keep_alive`)
and its waits (:func:`prompt_rendezvous`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import threading

from trainer.launch.worker import start_zygote, zygote_address
from trainer.launch.zygote import fork_zygote
from trainer.process import exit_code, leave


def rendezvous_id(argv: list[str], env: dict[str, str]) -> str:
    """The rendezvous id ft_launcher will take from ``argv`` or, as torch elastic's flags do, from
    ``PET_RDZV_ID`` (default ``none``): its workers' ``TORCHELASTIC_RUN_ID``, which names their zygote.
    """
    run_id = env.get("PET_RDZV_ID", "none")
    for i, arg in enumerate(argv):
        if arg in ("-m", "--module"):
            break  # the training module and its own flags follow
        name, _, value = arg.partition("=")
        if name in ("--rdzv-id", "--rdzv_id"):
            run_id = value if value or i + 1 >= len(argv) else argv[i + 1]
    return run_id


KEEP_ALIVE_S = 1.0
"""How often each node's agent renews its place in the rendezvous (NVRx: 5 s)."""
KEEP_ALIVE_ATTEMPTS = 5
"""Renewals missed before a node counts as dead and leaves the rendezvous (NVRx: 3)."""


def shorten_keep_alive() -> bool:
    """Make ft_launcher's rendezvous drop a dead node after :data:`KEEP_ALIVE_ATTEMPTS` missed
    renewals of :data:`KEEP_ALIVE_S` (5 s), not NVRx's fixed 3 of 5 s (15 s). Until then a lost
    node stays in the rendezvous, and the survivors and its replacement wait for it: that wait was
    most of a node loss's recovery (14 s of 15 in the netns test). Each agent writes the rendezvous
    state once a second instead of every 5 s: cheap at the tens of nodes a job has here. Checked
    against NVRx 0.4.1, where the handler passes both by keyword; elsewhere NVRx's stay (False).
    """
    from nvidia_resiliency_ext.fault_tolerance import _ft_rendezvous as rendezvous

    settings = getattr(rendezvous, "RendezvousSettings", None)
    fields = {f.name for f in dataclasses.fields(settings)} if dataclasses.is_dataclass(settings) else set()
    if not {"keep_alive_interval", "keep_alive_max_attempt"} <= fields:
        return False

    def shortened(*args: object, **kwargs: object) -> object:
        if "keep_alive_interval" in kwargs and "keep_alive_max_attempt" in kwargs:
            kwargs["keep_alive_interval"] = datetime.timedelta(seconds=KEEP_ALIVE_S)
            kwargs["keep_alive_max_attempt"] = KEEP_ALIVE_ATTEMPTS
        return settings(*args, **kwargs)

    rendezvous.RendezvousSettings = shortened
    return True


SYNC_POLL_S = 0.1
"""How stale a node's copy of the rendezvous state may be, and how often a node that waits for
its peers reads it again (NVRx: 1 s each)."""


def prompt_rendezvous() -> bool:
    """Take two waits out of ft_launcher's rendezvous, which NVRx 0.4.1 copied from torch elastic.

    - A node's first join is delayed by a random 0-0.3 s, to spread thousands of nodes over the
      store. The first join is told by the round number, which is still 0 at the first restart:
      every job's first in-job restart waited 0.15 s on average (the bimodal ``process_started``
      of a SIGKILL's recovery). Here only each agent's first join is delayed.
    - A node reads the rendezvous state at most once a second (it serves a cached copy in
      between), and one that waits for its peers polls it every 1 s. So a node that joined for a
      restart waited up to a second for its peers' agents to see it, and again for them to join:
      a 2-node job's restart after a SIGKILL took 1.4-2.6 s before its new workers started. Here
      both are :data:`SYNC_POLL_S`: each agent reads the small state from the store ten times a
      second, cheap at the tens of nodes a job has here.

    Returns False, changing nothing, where NVRx lacks one of the three.
    """
    from nvidia_resiliency_ext.fault_tolerance import _ft_rendezvous as rendezvous

    handler, delay = getattr(rendezvous, "FtRendezvousHandler", None), getattr(rendezvous, "_delay", None)
    holder = getattr(rendezvous, "_BackendRendezvousStateHolder", None)
    if handler is None or delay is None or holder is None or not hasattr(handler, "next_rendezvous"):
        return False

    class PromptStateHolder(holder):
        """The state holder that ``FtRendezvousHandler.from_backend`` builds, its cache shortened."""

        def __init__(self, backend: object, settings: object, cache_duration: float = SYNC_POLL_S) -> None:
            super().__init__(backend, settings, cache_duration)

    rejoining = threading.local()  # set while a handler that has joined before joins again

    def prompt_delay(seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple):  # the first join's random delay
            if getattr(rejoining, "on", False):
                return
        elif seconds == 1:  # the poll of a node that waits for its peers
            seconds = SYNC_POLL_S
        delay(seconds)

    join = handler.next_rendezvous

    def next_rendezvous(self: object) -> object:
        rejoining.on = getattr(self, "_rfsdp_joined", False)
        try:
            joined = join(self)
        finally:
            rejoining.on = False
        self._rfsdp_joined = True
        return joined

    rendezvous._delay = prompt_delay
    rendezvous._BackendRendezvousStateHolder = PromptStateHolder
    handler.next_rendezvous = next_rendezvous
    return True


def main() -> None:
    """Start the zygote, then run ft_launcher on this process's argv and leave with its exit code."""
    address = zygote_address(os.getpid(), rendezvous_id(sys.argv[1:], dict(os.environ)))
    if address is not None:
        import torch  # noqa: F401  (for both: ft_launcher's import and the zygote's)

        if fork_zygote(address) is None:
            start_zygote(address, os.getpid())
    from nvidia_resiliency_ext.fault_tolerance.launcher import main as ft_launcher

    shorten_keep_alive()
    prompt_rendezvous()
    sys.argv[0] = "ft_launcher"
    try:
        ft_launcher()
        code = 0
    except SystemExit as e:  # how it always ends
        code = exit_code(e)
    leave(code)


if __name__ == "__main__":
    main()
