"""Preemption: SIGTERM asks a rank to stop (an eviction, a drained node, ``rfsdp train`` stopped).

The ranks agree on the step in the loss's all-reduce, checkpoint it, then settle who leaves. With
every node asked, the run ends as ``preempted`` and every rank exits 0. With some nodes asked,
theirs exit ``PREEMPTED_EXIT_CODE`` (their pods end Failed and are replaced) and the others exit
``REJOIN_EXIT_CODE``: their launchers restart them into the rendezvous, which waits for the
replacements. If a leaving node held the rendezvous store, the others end their launchers too.
"""

from __future__ import annotations

import os
import signal

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

from trainer.errors import PREEMPTED_EXIT_CODE, REJOIN_EXIT_CODE
from trainer.events import NodesPreempted


class Preemption:
    """SIGTERM (eviction, preemption, ``rfsdp train`` stopped) asks this process to stop: the
    ranks agree on the step and checkpoint it. With every node asked, the run ends as
    ``preempted``. With some, their ranks leave with ``PREEMPTED_EXIT_CODE`` and the others
    with ``REJOIN_EXIT_CODE`` (:meth:`settle`). The request outlives in-process restarts.
    """

    def __init__(self) -> None:
        self.requested = False
        self.exit_code = 0
        """What this process exits with once training returns (0: the run ended here)."""
        self.end_launcher = False
        """Whether this rank asks its own launcher to end as it exits (:meth:`settle`)."""

    def install(self) -> None:
        """Handle SIGTERM from now on (main thread only)."""
        signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum: int, frame: object) -> None:
        self.requested = True

    def settle(self, group: dist.ProcessGroup, step: int) -> NodesPreempted | None:
        """Collective, once the stop ``step`` is checkpointed: which nodes leave and what the others
        do (None: every node leaves, the run ends as ``preempted``). Asked by node, not by rank:
        a launcher forwards SIGTERM to each of its ranks, which may see it a step apart. Asked
        after the checkpoint: the signals of one drain reach every node within it. Sets
        :attr:`exit_code` and :attr:`end_launcher`.
        """
        node = int(os.environ.get("GROUP_RANK", 0))
        every: list[tuple[int, bool, bool] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, (node, self.requested, hosts_rendezvous()), group=group)
        asked = sorted({n for n, stop, _ in every if stop})
        hosts = {n for n, _, host in every if host}
        nnodes = len({n for n, _, _ in every})
        if len(asked) == nnodes or len(hosts) == nnodes:  # every node, or nodes that share one host: the run ends
            return None
        # The rendezvous store lives in the launcher of the node that hosts it: when that node
        # leaves, the others' launchers must end too (their supervisor restarts them into the new one).
        others = "relaunch" if hosts & set(asked) else "wait"
        self.exit_code = PREEMPTED_EXIT_CODE if node in asked else REJOIN_EXIT_CODE
        self.end_launcher = others == "relaunch" and node not in asked
        return NodesPreempted(step=step, nodes=asked, nnodes=nnodes, others=others)


def hosts_rendezvous() -> bool:
    """Whether this node's launcher holds the rendezvous store, decided as ft_launcher decides it:
    ``is_host`` in ``PET_RDZV_CONF``, else whether the endpoint names this machine.
    """
    conf = dict(kv.split("=", 1) for kv in os.environ.get("PET_RDZV_CONF", "").split(",") if "=" in kv)
    if "is_host" in conf:
        return conf["is_host"].strip().lower() in ("1", "true", "yes", "y")
    endpoint = os.environ.get("PET_RDZV_ENDPOINT", "")
    return not endpoint or _matches_machine_hostname(parse_rendezvous_endpoint(endpoint, default_port=0)[0])
