"""Multi-node on one machine: every replica its own network-namespace host (trainer.emulation.netns).

Real namespaces, veth links and a bridge; real ft_launchers and workers per host; real node loss
(every process of a host SIGKILLed at once) and real partitions (the host's switch port down).
The cluster tests need root, `ip` and namespace support, and skip with the reason elsewhere.

Node faults' grammar and firing, without a cluster: tests/unit/test_netns.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, as_unprivileged, assert_nothing_of_the_run_left, losses, tier_of, train
from trainer.checkpoint import latest_checkpoint, published_checkpoints
from trainer.emulation.netns import LocalCluster, netns_problem
from trainer.events import Checkpoint, FaultFired, NodesPreempted, Restart, RunEnd, Step, read_events, select

PROBLEM = netns_problem()
needs_netns = pytest.mark.skipif(PROBLEM is not None, reason=f"namespace cluster unavailable here: {PROBLEM}")
STEPS = "40"


def netns_train(data: Path, run: Path, nproc: int, *extra: str) -> None:
    """`rfsdp train --netns` on 2 hosts; asserts it succeeded and left no namespace behind."""
    train(
        data, run, "--netns", "--nnodes", "2", "--nproc-per-node", str(nproc), "--ckpt-every", "5", *extra, timeout=600
    )
    assert not _our_namespaces()


def _our_namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [n for n in listed if n.startswith("rfsdp")]


def recoveries(run: Path) -> list[dict]:
    """For each fault: its kind, node, and the seconds from it to the first step completed after it."""
    events = read_events(run)
    out = []
    for fault in (e for e in events if isinstance(e, FaultFired)):
        first = next(e for e in events if isinstance(e, Step) and e.time > fault.time)
        recovery = round(first.time - fault.time, 2)
        out.append({"kind": fault.kind, "node": fault.node, "step": fault.step, "recovery_s": recovery})
    return out


def test_node_faults_need_netns(data_dir: Path, tmp_path: Path) -> None:
    proc = train(
        data_dir, tmp_path / "run", "--nnodes", "2", "--nproc-per-node", "1", "--fault", "node-loss@5:1", check=False
    )
    assert proc.returncode == 2 and "--fault: node-loss needs every replica on its own host (--netns)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "logs").exists()


def test_refuses_without_privileges(tmp_path: Path) -> None:
    """As an unprivileged user `--netns` is refused with the reason, before anything is created."""
    args = ["train", "--quiet", "--data", str(tmp_path), "--run-dir", str(tmp_path / "run"), "--nnodes", "2", "--netns"]
    command = as_unprivileged([sys.executable, "-m", "trainer.cli", *args])
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "rfsdp train: error: --netns: needs root" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- the cluster
@needs_netns
def test_cluster_hosts_are_separate_and_torn_down() -> None:
    with LocalCluster(2) as cluster:
        names = cluster.namespaces()
        assert len(names) == 3  # two hosts and the switch
        server = subprocess.Popen(
            cluster.replica_command(
                0,
                [
                    sys.executable,
                    "-c",
                    "import socket,sys; s=socket.create_server(('0.0.0.0', 5000)); "
                    "print('up', flush=True); c,_=s.accept(); c.sendall(b'pong')",
                ],
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout.readline().strip() == "up"
        reach = (
            "import socket; "
            f"print(socket.create_connection(('{cluster.hosts[0].address}', 5000), timeout=10).recv(4).decode())"
        )
        answer = subprocess.run(
            cluster.replica_command(1, [sys.executable, "-c", reach]), capture_output=True, text=True
        )
        assert answer.stdout.strip() == "pong"
        # The host's address is not this machine's: from the root namespace it is unreachable.
        root = subprocess.run([sys.executable, "-c", reach.replace("10)", "1)")], capture_output=True, text=True)
        assert root.returncode != 0
        sleeper = subprocess.Popen(cluster.replica_command(1, ["sleep", "600"]))
        # `ip netns exec` enters the namespace a moment after it starts: wait for it to get there.
        deadline = time.monotonic() + 30
        while sleeper.pid not in cluster.pids(1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleeper.pid in cluster.pids(1)
    assert not set(names) & set(_our_namespaces())
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    server.wait(timeout=10)


@needs_netns
def test_ctrl_c_tears_everything_down(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    # A run far longer than the wait below, so only Ctrl-C can end it in time; SIGINT restored to
    # its default in the child (a shell's background job starts with it ignored).
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "train",
            "--quiet",
            "--data",
            str(data_dir),
            "--run-dir",
            str(run),
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--netns",
            "--steps",
            "100000",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    tag = f"rfsdp{proc.pid}-"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # both hosts run their launcher
        hosts = [n for n in _our_namespaces() if n.startswith(tag + "h")]
        pids = [
            p
            for n in hosts
            for p in subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
        ]
        if len(hosts) == 2 and len(pids) >= 2:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the cluster did not come up: {proc.communicate(timeout=60)}")
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    assert not [n for n in _our_namespaces() if n.startswith(tag)]
    assert_nothing_of_the_run_left(run)


PUBLISH_PROBE = textwrap.dedent(
    """
    import datetime, json, os, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from trainer.checkpoint import Checkpointer
    from trainer.events import EventLog
    from trainer.rank.resilience import AsyncCheckpointWriter

    def main():
        run_dir, signals, rank = Path(sys.argv[1]), Path(sys.argv[2]), int(os.environ["RANK"])
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        writer = AsyncCheckpointWriter(cuda=False)
        model = torch.nn.Linear(64, 64)
        state = lambda step: ({"model": model.state_dict()}, {"step": step})
        events = EventLog(run_dir, rank)
        # First save: the background worker may boot seconds apart on the two hosts: a long timeout.
        slow = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=300))
        first = Checkpointer(run_dir, writer=writer, group=slow, events=events, every=1, keep_last=5, \
fingerprint="probe")
        first.save(1, lambda: state(1))
        first.finish()
        # Second save, ranks in step: a short timeout, so the cut is noticed quickly.
        fast = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
        second = Checkpointer(run_dir, writer=writer, group=fast, events=events, every=1, keep_last=5, \
fingerprint="probe")
        with torch.no_grad():
            model.weight.add_(1.0)
        second.save(2, lambda: state(2))
        part = next(run_dir.glob("checkpoints/step_000002.tmp*")) / f"checksums_rank{rank}.json"
        while not part.exists():  # this rank's part of step 2 is durable
            time.sleep(0.05)
        (signals / f"written{rank}").touch()
        while not (signals / "cut").exists():
            time.sleep(0.05)
        try:
            second.finish()
            outcome = "finished"
        except Exception as e:
            outcome = f"raised {type(e).__name__}"
        (signals / f"outcome{rank}").write_text(outcome)
        writer.close()
        os._exit(0)  # the process group cannot be torn down cleanly across a cut link

    if __name__ == "__main__":
        main()
    """
)


@needs_netns
def test_cut_off_rank_never_publishes(tmp_path: Path) -> None:
    """Rank 0 (it publishes) is cut off while its and rank 1's parts of step 2 are on the shared
    disk: rank 0 publishes only after a barrier over all ranks of the checkpoint group, so it
    never does, and `latest` stays on step 1.
    """
    run_dir, signals = tmp_path / "run", tmp_path / "signals"
    run_dir.mkdir()
    signals.mkdir()
    script = tmp_path / "probe.py"
    script.write_text(PUBLISH_PROBE)
    with LocalCluster(2) as cluster:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": cluster.hosts[0].address,
            "MASTER_PORT": "29500",
        }
        procs = [
            subprocess.Popen(
                cluster.replica_command(r, [sys.executable, str(script), str(run_dir), str(signals)]),
                env={**env, **cluster.replica_env(r), "RANK": str(r), "LOCAL_RANK": "0"},
                stderr=open(tmp_path / f"rank{r}.log", "w"),  # noqa: SIM115 (closed with the process)
            )
            for r in range(2)
        ]
        deadline = time.monotonic() + 300
        while not all((signals / f"written{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                tmp_path / "rank0.log"
            ).read_text()[-3000:]
            time.sleep(0.1)
        cluster.set_link(0, up=False)
        (signals / "cut").touch()
        for p in procs:
            p.wait(timeout=120)
    outcomes = [(signals / f"outcome{r}").read_text() for r in range(2)]
    assert all(o.startswith("raised") for o in outcomes), outcomes
    assert [s for s, _ in published_checkpoints(run_dir / "checkpoints")] == [1]
    assert latest_checkpoint(run_dir).name == "step_000001"
    pending = next((run_dir / "checkpoints").glob("step_000002.tmp*"))
    assert {p.name for p in pending.glob("checksums_rank*.json")} == {"checksums_rank0.json", "checksums_rank1.json"}
    assert [e.step for e in read_events(run_dir) if isinstance(e, Checkpoint)] == [1]


# ---------------------------------------------------------------- training through node loss and partitions
@pytest.fixture(scope="module")
def baseline_2(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 40-step run on 2 hosts x 1 process. Same world size is not enough: a
    1 x 2 run differs in the last bits (a rank's intra-op threads are CPUs / processes per node).
    """
    if PROBLEM is not None:
        pytest.skip(f"namespace cluster unavailable here: {PROBLEM}")
    run = tmp_path_factory.mktemp("netns_baseline2") / "run"
    netns_train(data_dir, run, 1, "--steps", STEPS)
    return run


@needs_netns
def test_node_loss_2x1_exact(data_dir: Path, baseline_2: Path, tmp_path: Path) -> None:
    """Host 1 is lost, later host 0 (it holds the rendezvous endpoint): each time the lost host's
    replica is restarted like a pod, rejoins, and the run continues on the same trajectory.
    """
    run = tmp_path / "run"
    netns_train(data_dir, run, 1, "--steps", STEPS, "--fault", "node-loss@12:1,node-loss@24:0", "--max-restarts", "5")
    assert losses(run) == losses(baseline_2)
    measured = recoveries(run)
    assert [(r["kind"], r["node"]) for r in measured] == [("node-loss", 1), ("node-loss", 0)]
    print(f"\nnode-loss recovery (fault -> first step after it), 2 hosts x 1 process: {json.dumps(measured)}")


@needs_netns
def test_node_loss_2x1_recovers_from_the_peer_replica(data_dir: Path, baseline_2: Path, tmp_path: Path) -> None:
    """Durable checkpoints every 10, local snapshots every step with one peer replica: host 1 is
    lost at step 13 and its memory (its local tier) with it, so its state can only come back from
    the replica host 0 holds. At most one step is lost, the trajectory is the uninterrupted one,
    and no host's memory keeps anything of the run afterwards."""
    run = tmp_path / "run"
    netns_train(
        data_dir, run, 1, "--steps", STEPS, "--ckpt-every", "10", "--local-ckpt-every", "1", "--fault", "node-loss@13:1"
    )
    assert losses(run) == losses(baseline_2)
    events = read_events(run)
    (restart,) = select(events, Restart)
    assert (restart.layer, restart.source) == ("in_job", "peer") and restart.lost_steps <= 1, restart
    assert restart.resumed_from_step > 10  # newer than the durable checkpoint
    local = [e for e in events if isinstance(e, Checkpoint) and e.tier == "local"]
    assert local and all("replicate" in e.phases for e in local)  # each snapshot went to the peer too
    assert not list(Path("/dev/shm").glob(f"rfsdp-local*/{tier_of(run).name}"))  # the run's folder in any host's memory
    print(
        f"\nnode loss, local tier + 1 replica: resumed from step {restart.resumed_from_step} ({restart.source}), "
        f"{restart.lost_steps} step(s) redone, {restart.recovery_s:.1f} s"
    )


@needs_netns
@pytest.mark.parametrize(("node", "others"), [(1, "wait"), (0, "relaunch")])
def test_a_preempted_node_checkpoints_and_the_run_goes_on_when_it_is_replaced(
    data_dir: Path, baseline_2: Path, tmp_path: Path, node: int, others: str
) -> None:
    """SIGTERM to one host's launcher (a drained node; the harness restarts it like a pod): every
    rank checkpoints the step reached, the preempted host's ranks leave with a failure (its pod
    must not end Succeeded: that completes an elastic job), and the run goes on from that step,
    exactly. Host 1's peer waits in the rendezvous: its launcher never restarts. Host 0 held the
    rendezvous store, so host 1's launcher ends and is relaunched with it.
    """
    run = tmp_path / "run"
    netns_train(data_dir, run, 1, "--steps", STEPS, "--fault", f"sigterm@12:{node}")
    assert losses(run) == losses(baseline_2)
    events = read_events(run)
    (left,) = select(events, NodesPreempted)
    assert (left.nodes, left.nnodes, left.others) == ([node], 2, others) and left.step >= 12
    (restart,) = select(events, Restart)
    assert (restart.layer, restart.resumed_from_step, restart.lost_steps) == ("in_job", left.step, 0)
    assert [e.status for e in select(events, RunEnd)] == ["completed"]
    launches = [(run / "logs" / f"replica_{n}.log").read_text().count("Starting elastic_operator") for n in (0, 1)]
    assert launches == ([1, 2] if others == "wait" else [2, 2])


@needs_netns
def test_partition_2x1_detected_recovered_nothing_published_while_cut(
    data_dir: Path, baseline_2: Path, tmp_path: Path
) -> None:
    """Host 0 (rank 0, the publisher) is cut off for 15 s, longer than the 10 s heartbeat timeout,
    right after the step-30 save started: detected (an in-job restart), recovered once the link is
    back, no checkpoint published while cut, same trajectory.
    """
    run = tmp_path / "run"
    netns_train(data_dir, run, 1, "--steps", STEPS, "--fault", "partition@31:0:15")
    assert losses(run) == losses(baseline_2)
    events = read_events(run)
    fault = next(e for e in events if isinstance(e, FaultFired))
    healed = fault.time + fault.seconds
    # A local snapshot is agreed in the next step's all-reduce, and its event follows that step's:
    # the step completed before the cut agreed one, whose event may come just after the cut.
    before = max(e.step for e in events if isinstance(e, Step) and e.time < fault.time)
    published = [
        e
        for e in events
        if isinstance(e, Checkpoint) and fault.time <= e.time <= healed and not (e.tier == "local" and e.step < before)
    ]
    assert not published
    restart = next(e for e in events if isinstance(e, Restart))
    assert restart.layer == "in_job" and restart.time > healed
    # The launcher sees steps late (it polls events.jsonl), so the cut lands a few steps after
    # step 30; once it is in place, only a step whose all-reduce was already done can complete.
    during = [e.step for e in events if isinstance(e, Step) and fault.time < e.time <= healed]
    assert len(during) <= 1, during
    first_after = next(e for e in events if isinstance(e, Step) and e.time > healed)
    for _, path in published_checkpoints(run / "checkpoints"):  # every published one verifies (rfsdp validate's check)
        from trainer.checkpoint import verify_checkpoint

        verify_checkpoint(path)
    recovery = first_after.time - fault.time
    print(f"\npartition 15 s: first step {recovery:.1f} s after the cut, resumed from step {restart.resumed_from_step}")


@needs_netns
def test_2x2_node_loss_and_partition_exact(data_dir: Path, tmp_path: Path) -> None:
    """Two hosts of two processes: loss of host 0 (the rendezvous endpoint), then a partition of
    host 1 longer than the heartbeat timeout; every step's final loss equals an uninterrupted 2x2
    run's. (Losing host 1 is the 2x1 test's first fault; each recovery costs ~45 s here.)
    """
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    netns_train(data_dir, baseline, 2, "--steps", "30")
    netns_train(data_dir, run, 2, "--steps", "30", "--fault", "node-loss@9:0,partition@21:1:12", "--max-restarts", "5")
    assert losses(run) == losses(baseline) and len(losses(run)) == 30
    print(f"\n2 hosts x 2 processes: {json.dumps(recoveries(run))}")
