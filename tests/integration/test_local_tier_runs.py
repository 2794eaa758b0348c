"""The local tier (``--local-ckpt-every``): each rank's snapshots in node memory, checksummed,
at most two per rank; recoveries resume from the newest one every rank can load, the trajectory
stays the uninterrupted one bit for bit, and a completed run leaves nothing in /dev/shm.

Here real jobs and the CLI; one rank in this process and the launcher's checks:
tests/unit/test_local_tier.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT, losses, rfsdp, tier_of, train
from trainer.events import Checkpoint, Restart, RunWarning, read_events, select, summarize

LOCAL = ("--ckpt-every", "10", "--local-ckpt-every", "1")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--nnodes", "1", "--local-ckpt-every", "1", "--local-replicas", "1"),
            "--local-replicas: 1 replica(s) of local snapshots need other nodes to hold them, but nnodes is 1",
        ),
        (
            ("--nnodes", "2", "--nproc-per-node", "1", "--local-ckpt-every", "1", "--local-replicas", "2"),
            "--local-replicas: 2 replicas of local snapshots need 3 nodes (one per copy), but nnodes is 2",
        ),
        (
            ("--nnodes", "2", "--nproc-per-node", "1", "--local-ckpt-every", "0", "--local-replicas", "1"),
            "--local-replicas: 1 replica(s) of local snapshots need --local-ckpt-every (0: off)",
        ),
        (
            ("--local-ckpt-every", "1", "--local-replicas", "-2"),
            "--local-replicas: must be at least 0 (or -1: the default rule), got -2",
        ),
    ],
)
def test_impossible_replicas_are_refused_before_launch(
    data_dir: Path, tmp_path: Path, flags: tuple[str, ...], message: str
) -> None:
    run = tmp_path / "run"
    proc = rfsdp("train", "--quiet", "--data", str(data_dir), "--run-dir", str(run), *flags)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (run / "events.jsonl").exists()


REPLICA_PROBE = textwrap.dedent(
    """
    import datetime, json, os, shutil, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from trainer.events import EventLog
    from trainer.rank.resilience import LocalTier, replication_groups

    def tier(root, run_dir, group):
        groups = replication_groups([[0, 1]], resume_timeout_s=60, save_timeout_s=60)
        return LocalTier(root, every=1, group=group, save_group=group, events=EventLog(run_dir, dist.get_rank()), \
replication=groups)

    def resume(root, run_dir, group):
        found = tier(root, run_dir, group)
        step, source = found.find_latest()
        restored = found.load(step)
        return {"step": step, "source": source, "w": restored["w"].tolist(), "saved_step": restored["rank"]["step"]}

    def main():
        root, run_dir, out, rank = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(os.environ["RANK"])
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        group = dist.new_group(backend="gloo")
        first = tier(root, run_dir, group)
        for step in (1, 2, 3):
            state = {"w": torch.full((3, 2), 10.0 * rank + step), "rank": {"step": step, "rng": torch.get_rng_state()}}
            first.step(step, lambda state=state: state)
        first.finish()
        held = sorted(p.name for p in first.directory.glob("iter_*_local.pt"))
        dist.barrier(group)
        if rank == 0:  # bit rot in rank 0's own newest snapshot; rank 1 holds a replica of it
            own = first.directory / "iter_0000003_0_local.pt"
            data = bytearray(own.read_bytes())
            data[len(data) // 2] ^= 0xFF
            own.write_bytes(bytes(data))
        dist.barrier(group)
        after_rot = resume(root, run_dir, group)
        dist.barrier(group)
        if rank == 1:  # then rank 1's node is replaced: nothing of its own, nor of its replicas, is left
            shutil.rmtree(first.directory)
        dist.barrier(group)
        after_loss = resume(root, run_dir, group)
        (out / f"rank{rank}.json").write_text(json.dumps({"held": held, "after_rot": after_rot, \
"after_loss": after_loss}))
        dist.destroy_process_group()

    if __name__ == "__main__":
        main()
    """
)


def test_a_rank_gets_its_snapshot_back_from_its_peer(tmp_path: Path) -> None:
    """Two real ranks over gloo, NVRx's clique replication with the CPU adaptations: each rank
    holds its own and its peer's snapshots of the two newest steps. With rank 0's own newest copy
    corrupt, rank 0 gets step 3 from rank 1's replica; once rank 1's folder is gone as well (a
    replaced node), step 3 has no intact copy of rank 0 left: both resume step 2, rank 1's from
    rank 0's replica."""
    script, out, run_dir = tmp_path / "probe.py", tmp_path / "out", tmp_path / "run"
    script.write_text(REPLICA_PROBE)
    out.mkdir()
    run_dir.mkdir()
    port = str(29000 + os.getpid() % 1000)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "tier" / "run"), str(run_dir), str(out)],
            env={**env, "RANK": str(r)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    errors = [p.communicate(timeout=180)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["held"] == [
            f"iter_000000{s}_{r}_local.pt" for s in (2, 3) for r in (0, 1)
        ]  # two steps x (own + peer's)
        assert result["after_rot"] == {"step": 3, "source": "peer", "w": [[10.0 * rank + 3] * 2] * 3, "saved_step": 3}
        assert result["after_loss"] == {"step": 2, "source": "peer", "w": [[10.0 * rank + 2] * 2] * 3, "saved_step": 2}
    skipped = [(e.rank, e.step, e.kind) for e in read_events(run_dir) if isinstance(e, RunWarning)]
    assert skipped == [(0, 3, "local_snapshot_skipped")] * 2  # found at each resume


# ------------------------------------------------------------------ refused before launch
def test_a_negative_interval_is_refused_before_launch(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = rfsdp("train", "--quiet", "--data", str(data_dir), "--run-dir", str(run), "--local-ckpt-every", "-2")
    message = "--local-ckpt-every: must be at least 1 (or 0: off, -1: the default rule), got -2"
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (run / "events.jsonl").exists()


# ------------------------------------------------------------------ real faults, 2 CPU ranks
@pytest.fixture(scope="module")
def local_faulted(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("local-faulted") / "run"
    train(data_dir, run, "--steps", "60", *LOCAL, "--fault", "exception@15:1,sigkill@27:0", timeout=600)
    return run


def test_each_fault_loses_at_most_one_step_and_the_trajectory_is_exact(local_faulted: Path, baseline_60: Path) -> None:
    events = read_events(local_faulted)
    restarts = select(events, Restart)
    assert [(r.layer, r.source) for r in restarts] == [("in_process", "local"), ("in_job", "local")]
    for restart, fault_step in zip(restarts, (15, 27), strict=True):
        assert restart.lost_steps <= 1 and restart.resumed_from_step == fault_step - 1 - restart.lost_steps
    assert losses(local_faulted) == losses(baseline_60)
    durable = [e.step for e in events if isinstance(e, Checkpoint) and e.tier == "durable"]
    assert durable and all(step % 10 == 0 for step in durable)
    # Every step but the last, less the one each fault may cut (a write in flight when it hit: CI met both cut).
    assert summarize(events)["local_snapshots"] >= 59 - len(restarts)


def test_a_completed_run_leaves_nothing_in_dev_shm(local_faulted: Path) -> None:
    assert [e for e in read_events(local_faulted) if isinstance(e, Checkpoint) and e.tier == "local"]
    assert not tier_of(local_faulted).exists()


def test_a_corrupt_local_snapshot_is_skipped_for_the_older_one(
    data_dir: Path, baseline_60: Path, tmp_path: Path
) -> None:
    """Rank 1 flips a byte of its newest snapshot (step 14) and raises: every rank resumes from step
    13, the newest one all of them verify. A run stopped (not completed) has its tier removed too
    when ``rfsdp train`` ends: /dev/shm is memory, and its last step is durable."""
    run = tmp_path / "run"
    try:
        train(data_dir, run, "--steps", "60", "--stop-at-step", "20", *LOCAL, "--fault", "corrupt-local@15:1")
        events = read_events(run)
        (skipped,) = [e for e in events if isinstance(e, RunWarning) and e.kind == "local_snapshot_skipped"]
        assert (skipped.rank, skipped.step) == (1, 14) and "fails its checksum" in skipped.reason
        (restart,) = select(events, Restart)
        assert (restart.layer, restart.source, restart.resumed_from_step, restart.lost_steps) == (
            "in_process",
            "local",
            13,
            1,
        )
        assert losses(run) == {step: loss for step, loss in losses(baseline_60).items() if step <= 20}
        assert [e.step for e in select(events, Checkpoint) if e.tier == "local"][-2:] == [
            18,
            19,
        ]  # written, then removed
        assert not tier_of(run).exists()
    finally:
        shutil.rmtree(tier_of(run), ignore_errors=True)
