"""In-process restart: the training function inside NVRx's ``inprocess.Wrapper``, with the
wrapper's timeouts, its store, and its abort, which first cuts the attempt's gloo connections
(``trainer.rank.connections``, which touches no NVRx).
"""

# No ``from __future__ import annotations`` here: inprocess.Wrapper finds the CallWrapper
# parameter by its (evaluated) annotation.
import datetime
import os
import sys
from collections.abc import Callable

from nvidia_resiliency_ext import inprocess

from trainer.rank.config import Timeouts
from trainer.rank.connections import Attempt, CollectiveConnections, wait_until_listening

PORT_BASE_ENV = "RFSDP_PORT_BASE"


class _AbortAttempt(inprocess.abort.Abort):
    """NVRx's abort for an in-process restart, preceded by cutting the attempt's gloo connections."""

    def __init__(self, connections: CollectiveConnections, on_abort: Callable[[], None]) -> None:
        self._connections = connections
        self._on_abort = on_abort
        self._torch = inprocess.abort.AbortTorchDistributed()

    def __call__(self, state: inprocess.state.FrozenState) -> inprocess.state.FrozenState:
        try:
            self._on_abort()
            cut = self._connections.cut()
            print(
                f"rank {state.rank}: in-process restart: cut {cut} connections of the attempt's groups",
                file=sys.stderr,
                flush=True,
            )
        finally:  # the groups go whatever happened above: the next attempt makes its own
            self._torch(state)
        return state


def _port_base() -> int:
    # Every rank of a rendezvous round must agree: the round's MASTER_PORT does (a fresh random port
    # each round), the restart count does not (a replaced replica's launcher counts from 0 again).
    return int(os.environ.get(PORT_BASE_ENV, 29600)) + 100 * (int(os.environ.get("MASTER_PORT", 0)) % 16)


class _WrapperStore(inprocess.store.TCPStore):
    """NVRx's store for the wrapper, made as a rank starts: its clients first wait for the host
    rank's server to listen (:func:`wait_until_listening`), where a start or an in-job restart
    often waited half a second for c10d's retry.
    """

    def __init__(self, *, port: int, timeout: datetime.timedelta) -> None:
        if int(os.environ["RANK"]) != self.TCP_STORE_HOST_RANK:
            wait_until_listening(os.environ["MASTER_ADDR"], port, timeout.total_seconds())
        super().__init__(port=port, timeout=timeout)


def wrapper_timeouts(timeouts: Timeouts) -> dict[str, datetime.timedelta]:
    """NVRx ``inprocess.Wrapper``'s timeouts, from the run's one hang timeout."""
    return {
        "soft_timeout": datetime.timedelta(seconds=timeouts.soft),
        "hard_timeout": datetime.timedelta(seconds=timeouts.hard),
        "heartbeat_timeout": datetime.timedelta(seconds=timeouts.wrapper_heartbeat),
        "barrier_timeout": datetime.timedelta(seconds=timeouts.barrier),
        "completion_timeout": datetime.timedelta(seconds=timeouts.barrier),
        # How long a rank waits after the first fault before it aborts: failures reported within it
        # are named together in the restart's message, later ones only in their ranks' logs.
        # NVRx's 1 s was most of a restart once a blocked collective fails at the abort.
        "last_call_wait": datetime.timedelta(seconds=0.1),
    }


def run_restartable(
    train_fn: Callable[[Attempt], None],
    timeouts: Timeouts,
    *,
    cuda: bool,
    max_restarts: int,
    on_abort: Callable[[], None] = lambda: None,
) -> None:
    """Run ``train_fn`` inside NVRx's ``inprocess.Wrapper``: a Python exception or a stuck rank
    restarts it in the same processes with a fresh store and process group, at most
    ``max_restarts`` times. Faults it cannot handle (a killed process, a rank stuck in C code past
    the hard timeout, one restart too many) end the processes and ft_launcher's in-job restart
    takes over. ``on_abort`` runs first in each abort, while the wrapper holds the attempt's
    ``atomic`` (the step watch ends there: the restart's time is no step's).
    """
    base = _port_base()
    connections = CollectiveConnections(spared_ports=frozenset({base}))  # the wrapper's store stays
    wrapper = inprocess.Wrapper(
        # A rank that is gone (killed, or ended by a fatal error) is never trained without: the
        # wrapper would shrink the world; in-job restart brings the whole job back instead.
        initialize=inprocess.initialize.RetryController(
            max_iterations=max_restarts + 1, min_world_size=int(os.environ["WORLD_SIZE"])
        ),
        store_factory=_WrapperStore,
        store_kwargs={"port": base, "timeout": datetime.timedelta(seconds=timeouts.barrier)},
        health_check=inprocess.health_check.CudaHealthCheck() if cuda else None,
        abort=_AbortAttempt(connections, on_abort),
        **wrapper_timeouts(timeouts),
    )

    def wrapped(call_wrapper: inprocess.CallWrapper | None = None) -> None:
        n = call_wrapper.iteration  # NVRx's count of calls: this attempt's, from 0
        hooks = {"atomic": call_wrapper.atomic, "heartbeat": call_wrapper.ping, "connections": connections}
        connections.aborted = False  # a new attempt: the last one's abort is over
        train_fn(Attempt(in_process_attempt=n, store_port=base + 1 + n, **hooks))

    wrapper(wrapped)()
