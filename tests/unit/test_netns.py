"""Node faults without a cluster: their grammar and their firing (trainer.faults). The
network-namespace hosts themselves (trainer.emulation.netns): tests/e2e/test_netns_e2e.py.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from trainer.events import FaultFired, read_events
from trainer.faults import Fault, NodeFault, NodeFaultInjector, parse_fault_spec


# ---------------------------------------------------------------- spec grammar and firing (no cluster)
def test_node_fault_grammar() -> None:
    faults = parse_fault_spec("node-loss@5:1, partition@9:0:12.5, sigkill@3:1", steps=20, world_size=4, nnodes=2)
    assert faults == [NodeFault("node-loss", 5, 1), NodeFault("partition", 9, 0, 12.5), Fault("sigkill", 3, 1)]


def test_sigterms_on_several_ranks_may_share_a_step_and_nothing_else_may() -> None:
    """Preempting several nodes at once (the whole job) is one event, not a race between faults."""
    assert parse_fault_spec("sigterm@6:0,sigterm@6:1", steps=10, world_size=2) == [
        Fault("sigterm", 6, 0),
        Fault("sigterm", 6, 1),
    ]
    for spec in ("sigterm@6:0,sigkill@6:1", "sigkill@6:0,sigterm@6:1", "sigterm@6/write:0,sigterm@6:1"):
        with pytest.raises(ValueError, match="one fault per step"):
            parse_fault_spec(spec, steps=10, world_size=2)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("node-loss@5:2", "node 2 .* outside the job \\(nodes 2\\)"),
        ("partition@5:1", "needs the partition's length"),
        ("partition@5:1:0", "needs the partition's length"),
        ("node-loss@5:1:3", "node-loss takes no SECONDS"),
        ("sigkill@5:1:3", "only partition takes SECONDS"),
        ("node-loss@99:1", "outside the run"),
    ],
)
def test_bad_node_fault_is_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"--fault: .*{message}"):
        parse_fault_spec(spec, steps=20, world_size=4, nnodes=2)


class _Recorder:
    """A NodeControl that records what it was asked to do (the firing logic, without a cluster)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def kill_node(self, node: int) -> None:
        self.calls.append(("kill", node))

    def set_link(self, node: int, up: bool) -> None:
        self.calls.append(("link", node, up))


def test_node_faults_fire_once_at_their_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]  # the injector's monotonic clock, moved by hand: a loaded machine cannot heal the link early
    monkeypatch.setattr("trainer.faults.time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    faults = parse_fault_spec("node-loss@3:1,partition@5:0:0.2", steps=10, world_size=2, nnodes=2)
    control = _Recorder()
    injector = NodeFaultInjector(faults, tmp_path, control)
    injector.observe(1)
    assert control.calls == []
    injector.observe(2)  # step 2 done: the run reaches step 3
    assert control.calls == [("kill", 1)]
    injector.observe(4)
    clock[0] += 0.19
    injector.tick()
    assert control.calls[-1] == ("link", 0, False)
    clock[0] += 0.02
    injector.tick()
    assert control.calls[-1] == ("link", 0, True)
    fired = [(e.kind, e.step, e.node, e.rank) for e in read_events(tmp_path) if isinstance(e, FaultFired)]
    assert fired == [("node-loss", 3, 1, -1), ("partition", 5, 0, -1)]
    again = _Recorder()  # a relaunch of the same run: the markers say both already fired
    NodeFaultInjector(faults, tmp_path, again).observe(9)
    assert again.calls == []
