"""Real faults under ft_launcher (2 CPU ranks): the right layer recovers each, and the trajectory
equals an uninterrupted run's bit for bit; async checkpoints are consistent.

Nothing here depends on how fast a write is compared with a step (steps outrun the background
writer on a quiet machine, and fall behind it under load): faults that must meet a save in flight
fire at a phase of that save (``KIND@STEP/PHASE``), and where a fault meets whatever happens to be
durable, the expectation is read from the run's own events.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.synchronize
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from tests.conftest import ROOT, assert_nothing_of_the_run_left, losses, train, why_it_restarted
from tests.integration.test_training import assert_same_tensors
from trainer.checkpoint import CHECKPOINTS, latest_checkpoint, read_full_state, step_dir_name, verify_checkpoint
from trainer.errors import FATAL_EXIT_CODE
from trainer.events import (
    SAVE_PHASES,
    Checkpoint,
    CheckpointFailed,
    Fatal,
    FaultFired,
    Restart,
    RunEnd,
    RunStart,
    Step,
    corrupt_lines,
    read_events,
    select,
)
from trainer.launch.local import free_port
from trainer.rank.config import Timeouts
from trainer.rank.pace import PACE_FLOOR_S, STEP_SECTION
from trainer.rank.resilience import CollectiveConnections


def restarts(run: Path) -> list[dict]:
    return [e for e in read_events(run) if isinstance(e, Restart)]


@dataclass
class FaultedRun:
    run: Path
    stdout: str


# One 60-step run meets every rank fault in turn (and a torn events line); each fault's own test
# reads its recovery from that run: one job instead of one per fault.
EACH_FAULT = {"exception@12:1": "in_process", "sigkill@23:0": "in_job", "hang@34:1": "in_job", "exit@45:0": "in_job"}


@pytest.fixture(scope="module")
def faulted_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FaultedRun:
    run = tmp_path_factory.mktemp("faulted") / "run"
    faults = ",".join(EACH_FAULT) + ",corrupt-event@50"
    proc = train(
        data_dir, run, "--steps", "60", "--local-ckpt-every", "0", "--fault", faults, "--max-restarts", "5", timeout=900
    )
    return FaultedRun(run, proc.stdout)


@pytest.fixture(scope="module")
def faulted_run_local(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same faults with the default tiers: a durable checkpoint every 10 steps, a local snapshot every step."""
    run = tmp_path_factory.mktemp("faulted_local") / "run"
    train(data_dir, run, "--steps", "60", "--fault", ",".join(EACH_FAULT), "--max-restarts", "5", timeout=900)
    return run


@pytest.mark.parametrize(("fault", "layer"), EACH_FAULT.items())
def test_each_fault_is_recovered_exactly(faulted_run: FaultedRun, baseline_60: Path, fault: str, layer: str) -> None:
    kind, step = fault.split(":")[0].split("@")
    step = int(step)
    events = read_events(faulted_run.run)
    (fired,) = [e for e in events if isinstance(e, FaultFired) and e.kind == kind]
    assert fired.step == step
    restart = next(e for e in events if isinstance(e, Restart) and e.time > fired.time)  # the recovery that follows it
    assert restart.layer == layer
    # The last interval's async save may still be in flight at the fault (then the run resumes
    # from the one before); once its publication is recorded, the run resumes from it.
    due = (step - 1) // 10 * 10
    resumed = restart.resumed_from_step
    published = [e.step for e in events if isinstance(e, Checkpoint) and e.time < restart.time]
    assert resumed in (due, due - 10) and (resumed == due or due not in published)
    assert restart.lost_steps == step - 1 - resumed and restart.recovery_s > 0
    assert losses(faulted_run.run) == losses(baseline_60)


@pytest.mark.parametrize(("fault", "layer"), EACH_FAULT.items())
def test_each_fault_loses_at_most_one_step_with_the_local_tier(
    faulted_run_local: Path, baseline_60: Path, fault: str, layer: str
) -> None:
    """Every rank fault, hang included, resumes from the snapshot in its node's memory: at most one
    step redone (the last step's snapshot may still be being written when the fault comes)."""
    kind, step = fault.split(":")[0].split("@")
    events = read_events(faulted_run_local)
    (fired,) = [e for e in events if isinstance(e, FaultFired) and e.kind == kind]
    restart = next(e for e in events if isinstance(e, Restart) and e.time > fired.time)
    assert (restart.layer, restart.source) == (layer, "local"), restart
    assert restart.lost_steps <= 1 and restart.resumed_from_step == int(step) - 1 - restart.lost_steps
    assert losses(faulted_run_local) == losses(baseline_60)


def test_a_hang_is_found_by_the_step_watch_at_the_runs_pace(faulted_run: FaultedRun) -> None:
    """The hung rank's step outlasted its watch (a multiple of the run's recent step times, at least
    the floor, below the 10 s heartbeat timeout): the rank monitor ended it for that, with no
    heartbeat timeout reached. The exception's in-process restart (above) was not taken for a hang.
    """
    log = "".join(p.read_text() for p in sorted((faulted_run.run / "logs").glob("replica_*.log")))
    watches = [
        (float(open_s), float(watch))
        for open_s, watch in re.findall(
            rf"Section '{STEP_SECTION}' has been open for ([\d.]+) seconds\. Timeout is ([\d.]+) seconds\.", log
        )
    ]
    assert watches, log[-3000:]  # one per rank: both were inside step 34, one hung, one waiting on it
    heartbeat_timeout = Timeouts(10.0, inprocess=True).heartbeat  # the run's default hang timeout
    # The monitor fires once a section is open longer than its timeout, and prints both to two
    # decimals: 2.503 s open reads "2.50", as its timeout does.
    assert all(PACE_FLOOR_S <= watch < heartbeat_timeout and open_s >= watch for open_s, watch in watches), watches
    assert "Did not get subsequent heartbeat" not in log


def test_rank_0_prints_progress_and_each_restart(faulted_run: FaultedRun) -> None:
    """What ``kubectl logs`` of worker 0 shows: a line every 10 steps and one per restart."""
    log = "".join(p.read_text() for p in sorted((faulted_run.run / "logs").glob("replica_*.log")))
    for r in restarts(faulted_run.run):
        assert (
            f"restart {r.attempt} ({r.layer}): resumed from step {r.resumed_from_step}, {r.lost_steps} steps redone"
            in log
        )
    assert re.search(r"^step 60/60  loss \d+\.\d{4}  [\d,]+ tok/s  restarts 4$", log, re.MULTILINE), log[-2000:]
    assert {int(m) for m in re.findall(r"^step (\d+)/60 ", log, re.MULTILINE)} >= {10, 20, 30, 40, 50, 60}


def test_an_in_process_restart_cuts_the_faulted_attempts_connections(faulted_run: FaultedRun) -> None:
    """The wrapper's abort runs on every rank and shuts down the attempt's gloo connections, so the
    rank that did not fault is not left waiting out gloo's timeout in a collective with the one
    that did (how that fails the collective: the two-rank test below). Whichever rank cuts first
    ends both sides' connections: gloo closes its own on the peer's end of stream, so the later
    rank may find none left to cut."""
    log = "".join(p.read_text() for p in sorted((faulted_run.run / "logs").glob("replica_*.log")))
    cuts = re.findall(r"^rank (\d+): in-process restart: cut (\d+) connections", log, re.MULTILINE)
    assert {rank for rank, _ in cuts} == {"0", "1"}, cuts
    assert any(int(count) > 0 for _, count in cuts), cuts


def test_every_recovery_and_save_has_its_timeline(faulted_run: FaultedRun) -> None:
    """Where each second went, from the events a production run writes: phases in order, ending
    with the recovery (or the save's publication)."""
    for r in restarts(faulted_run.run):
        # a new process: a fresh interpreter's imports, or a fork of the node's zygote (once it has imported)
        start = "forked" if "forked" in r.phases else "imports_done"
        new_process = ["process_started", start, "set_up"] if r.layer == "in_job" else []
        stages = ["wrapper_ready", "runtime", "store", "default_group", "process_group", "rank_monitor"]
        stages += ["model_built", "resumed", "first_step"]
        assert list(r.phases) == [*new_process, *stages], r
        assert list(r.phases.values()) == sorted(r.phases.values()) and r.phases["first_step"] == r.recovery_s
    saves = [e for e in read_events(faulted_run.run) if isinstance(e, Checkpoint)]
    async_phases = [
        "wait",
        "collect",
        "rank_state",
        "stage",
        "plan",
        "handoff",
        "copy",
        "copy_wait",
        "digest",
        "background",
        "agree",
        "publish",
    ]
    # the first save of an attempt first reports the writer's warm-up, done steps before it
    assert saves and list(saves[0].phases) == ["prepare", *async_phases]
    for c in saves:
        save_phases = {k: v for k, v in c.phases.items() if k != "prepare"}
        assert list(save_phases) == async_phases and min(c.phases.values()) >= 0
        stalled = (
            sum(list(save_phases.values())[:6]) + save_phases["copy_wait"]
        )  # up to the hand-off, then for the copy
        assert abs(stalled - c.blocking_s) < 1e-6


def _rank_of_an_aborted_attempt(
    rank: int, port: int, out: multiprocessing.Queue, rank_0_done: multiprocessing.synchronize.Event
) -> None:
    """One rank of two: rank 0 enters a collective that rank 1 never joins; rank 1 aborts the
    attempt as the in-process wrapper does. Then both make the next attempt's group."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    connections = CollectiveConnections()
    group = {"rank": rank, "world_size": 2, "timeout": datetime.timedelta(seconds=120)}
    with connections.recording():
        dist.init_process_group("gloo", store=dist.PrefixStore("0", store), **group)
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        out.put(("cut", connections.cut()))
        rank_0_done.wait(90)  # the group lives on meanwhile (in the trainer, the model's mesh holds it)
    else:
        try:
            dist.all_reduce(torch.ones(1))
            out.put(("blocked", "returned"))
        except RuntimeError as e:
            out.put(("blocked", str(e)))
        rank_0_done.set()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("1", store), **group)
    total = torch.ones(1)
    dist.all_reduce(total)
    out.put((f"next attempt on rank {rank}", total.item()))
    dist.barrier()
    dist.destroy_process_group()


def test_an_abort_fails_a_collective_blocked_on_a_faulted_peer_at_once() -> None:
    """gloo's own abort does nothing: without cutting the attempt's connections, rank 0 would wait
    out the group's 120 s timeout (and this test fail at its 60 s wait). With them cut it fails
    with gloo's closed connection, and the next attempt's group works on both ranks."""
    context = multiprocessing.get_context("spawn")
    out, rank_0_done = context.Queue(), context.Event()
    port = free_port()
    ranks = [
        context.Process(target=_rank_of_an_aborted_attempt, args=(rank, port, out, rank_0_done)) for rank in (0, 1)
    ]
    for process in ranks:
        process.start()
    try:
        results = dict(out.get(timeout=60) for _ in range(4))
    finally:
        for process in ranks:
            process.join(30)
            process.kill()
    assert results["cut"] >= 1
    assert "Connection closed by peer" in results["blocked"], results
    assert results["next attempt on rank 0"] == results["next attempt on rank 1"] == 2.0


def test_a_recurring_soft_fault_is_handed_to_in_job_restart(data_dir: Path, baseline_60: Path, tmp_path: Path) -> None:
    """Three exceptions in a row on the same workers, two in-process restarts allowed: the third
    ends the workers and ft_launcher restarts them; the new workers may restart in-process again."""
    run = tmp_path / "run"
    faults = "exception@12:1,exception@13:1,exception@14:0,exception@25:1"
    train(data_dir, run, "--steps", "60", "--fault", faults, "--max-inprocess-restarts", "2")
    assert [r.layer for r in restarts(run)] == ["in_process", "in_process", "in_job", "in_process"]
    assert losses(run) == losses(baseline_60)


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` busy-looping processes while the block runs: a loaded machine."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_a_step_slower_than_the_hang_timeout_is_not_a_hang(data_dir: Path, tmp_path: Path) -> None:
    """The base model's steps here outlast the wrapper's soft timeout at the smallest hang timeout
    (4 s at 5 s), beside a busy loop on every core; the ranks report progress from within each
    step and while the writer makes its buffers (seconds, after step 1), so neither the in-process
    wrapper nor ft_launcher takes slow work for a hang (before, the second one restarted the job,
    and on a loaded machine the first one restarted at the buffers).
    """
    run = tmp_path / "run"
    base = ("--model", "base", "--batch-size", "2", "--local-ckpt-every", "0")
    with busy_loops(os.cpu_count() or 1):
        train(data_dir, run, *base, "--steps", "2", "--ckpt-every", "2", "--hang-timeout", "5")
    events = read_events(run)
    # The case at hand: a watched step slower than the soft timeout. (The first step is not
    # watched: the wrapper's watchdog starts at the first report after it.)
    assert max(e.step_time_s for e in select(events, Step) if e.step > 1) > Timeouts(5, inprocess=True).soft
    assert restarts(run) == [], why_it_restarted(run)
    assert [e.status for e in select(events, RunEnd)] == ["completed"]


def test_steps_slowed_by_a_busy_machine_midway_are_not_taken_for_hangs(data_dir: Path, tmp_path: Path) -> None:
    """The step watch is set from a quiet start (the small model), then two busy loops start on
    every core: the watched steps beside them restart nothing (the watch is a multiple of the
    slowest recent step, at least the floor).

    Whether the loops slowed the steps is not asserted: beside the other test worker the "quiet"
    steps were twice as slow as those beside the loops (0.85 s against 0.70 s, and 1.17 s against
    0.67 s). What is asserted is that the loops took a share of the cores while the steps ran."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--data", str(data_dir), "--run-dir", str(run)]
    cmd += ["--model", "small", "--steps", "14", "--ckpt-every", "7", "--local-ckpt-every", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, quiet_until = time.monotonic() + 300, 5  # steps 2-4 are timed, so step 5 is watched
    while max((e.step for e in read_events(run, [Step]) if isinstance(e, Step)), default=0) < quiet_until:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    with busy_loops(2 * (os.cpu_count() or 1)) as hogs:  # two a core
        began = time.monotonic()
        _, err = proc.communicate(timeout=600)
        loaded_s = time.monotonic() - began
        hogs_cpu_s = sum(sum(psutil.Process(hog.pid).cpu_times()[:2]) for hog in hogs)
    assert proc.returncode == 0, err[-3000:]
    # A quarter of a core at least went to the loops (beside a CI run, 0.39 of one)
    assert hogs_cpu_s > 0.25 * loaded_s, (hogs_cpu_s, loaded_s)
    steps = select(read_events(run), Step)
    assert restarts(run) == [], why_it_restarted(run)
    assert [e.step for e in steps] == list(range(1, 15))
    log = "".join(p.read_text() for p in sorted((run / "logs").glob("replica_*.log")))
    watched = [int(n) for n in re.findall(r"^rank \d: (\d+) steps watched at the run's pace", log, re.MULTILINE)]
    # Step 6, the first beside the loops, was watched at the quiet pace (a watch that would reach
    # the heartbeat timeout is not set: on a slow machine the later ones may not be).
    assert len(watched) == 2 and min(watched) >= 2, log[-3000:]


def test_sigterm_preempts_the_whole_job_gracefully(data_dir: Path, tmp_path: Path) -> None:
    """A scheduler stops `rfsdp train` with SIGTERM: every rank finishes its step, the step reached
    is checkpointed, the run ends `preempted`, the command exits 0, and no process is left."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "trainer.cli",
        "train",
        "--quiet",
        "--data",
        str(data_dir),
        "--run-dir",
        str(run),
        "--steps",
        "1000",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not any(isinstance(e, Step) for e in read_events(run)):  # the workers are training
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    (end,) = [e for e in read_events(run) if isinstance(e, RunEnd)]
    assert proc.returncode == 0 and f"preempted at step {end.step}" in err, err
    assert end.status == "preempted" and end.step < 1000
    assert latest_checkpoint(run).name == step_dir_name(
        end.step
    )  # the step reached, off the checkpoint interval or not
    verify_checkpoint(latest_checkpoint(run))
    assert_nothing_of_the_run_left(run)


def test_a_preempted_rank_stops_every_rank_and_the_run_resumes_exactly(
    data_dir: Path, baseline_60: Path, tmp_path: Path
) -> None:
    """`sigterm@20:1` preempts rank 1's container (SIGTERM to its ft_launcher, which forwards it):
    the ranks agree on a step, checkpoint it and exit 0; the same command resumes, which is a
    resume (`run_start`), not a fault recovery, and the trajectory is the uninterrupted one."""
    run = tmp_path / "run"
    train(data_dir, run, "--steps", "60", "--fault", "sigterm@20:1")
    end = [e for e in read_events(run) if isinstance(e, RunEnd)][-1]
    assert end.status == "preempted" and 20 <= end.step < 60
    assert latest_checkpoint(run).name == step_dir_name(end.step)
    train(data_dir, run, "--steps", "60", "--fault", "sigterm@20:1")
    events = read_events(run)
    assert [e.resumed_from_step for e in events if isinstance(e, RunStart)] == [0, end.step]
    for start in select(events, RunStart):  # each start's timeline: from the launcher's start to the resume, in order
        assert list(start.phases)[0] == "process_started" and list(start.phases)[-1] == "resumed"
        assert {"forked", "process_group", "model_built"} <= set(start.phases)  # a fork of the node's zygote
        assert start.phases["process_started"] >= 0 and list(start.phases.values()) == sorted(start.phases.values())
    assert not restarts(run) and [e.status for e in events if isinstance(e, RunEnd)] == ["preempted", "completed"]
    assert losses(run) == losses(baseline_60)


def test_exception_without_inprocess_falls_to_in_job(data_dir: Path, baseline_60: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(data_dir, run, "--steps", "60", "--fault", "exception@15:1", "--no-inprocess-restart")
    assert [r.layer for r in restarts(run)] == ["in_job"]
    assert losses(run) == losses(baseline_60)


def test_all_four_faults_in_one_run(faulted_run: FaultedRun) -> None:
    """Four recoveries in order, counted; a torn line in the middle of events.jsonl is skipped by
    every reader and reported once by the summary."""
    assert [r.layer for r in restarts(faulted_run.run)] == ["in_process", "in_job", "in_job", "in_job"]
    assert [r.attempt for r in restarts(faulted_run.run)] == [1, 2, 3, 4]
    (torn,) = corrupt_lines(faulted_run.run)
    assert "corrupt event lines" in faulted_run.stdout and f"1 skipped (line {torn})" in faulted_run.stdout
    # Nothing of the job outlives it: not a killed rank's checkpoint writer, nor the process that
    # writer forked for a write in flight (before, one was left stuck on a lock about every other run).
    assert_nothing_of_the_run_left(faulted_run.run)


def test_restarts_exhausted_keeps_last_good_checkpoint(data_dir: Path, tmp_path: Path) -> None:
    """The second kill fires in step 30's save after its planning collective: every rank got there
    only after step 20 was published (a save first waits for the one before it)."""
    run = tmp_path / "run"
    proc = train(
        data_dir, run, "--steps", "40", "--fault", "sigkill@15:0,sigkill@30/plan:1", "--max-restarts", "1", check=False
    )
    assert proc.returncode == 1 and "failed" in proc.stderr
    events = read_events(run)
    assert isinstance(events[-1], RunEnd) and events[-1].status == "failed"
    assert latest_checkpoint(run).name == "step_000020"
    verify_checkpoint(latest_checkpoint(run))


def test_a_full_disk_ends_the_job_for_good_and_keeps_the_last_checkpoint(data_dir: Path, tmp_path: Path) -> None:
    """ENOSPC on rank 1 (a real write to /dev/full): no in-process restart, a fatal event, ft_launcher's
    bounded restarts of the job exit at once, ``rfsdp train`` exits 3 naming the error."""
    run = tmp_path / "run"
    proc = train(
        data_dir,
        run,
        "--steps",
        "30",
        "--ckpt-every",
        "5",
        "--fault",
        "enospc@12:1",
        "--max-restarts",
        "2",
        check=False,
    )
    assert proc.returncode == FATAL_EXIT_CODE, proc.stderr
    assert "no restart can fix" in proc.stderr and "No space left on device" in proc.stderr
    events = read_events(run)
    (fatal,) = [e for e in events if isinstance(e, Fatal)]
    assert fatal.rank == 1 and "[Errno 28]" in fatal.error and fatal.job
    assert not [e for e in events if isinstance(e, Restart)]  # no recovery was attempted
    assert max(e.step for e in events if isinstance(e, Step)) <= 12
    assert isinstance(events[-1], RunEnd) and (events[-1].status, events[-1].exit_code) == ("failed", FATAL_EXIT_CODE)
    # ft_launcher restarted the workers (it restarts any failure) within its budget; each exited at
    # once, before any recovery (above). The launcher stops a rank's sibling once it exits: a rank
    # still importing may be stopped before it says so itself.
    log = (run / "logs" / "replica_0.log").read_text()
    restarted = log.count("will restart worker group")
    assert 1 <= restarted <= 2
    assert restarted <= log.count("not restarting, the job met an error no restart can fix") <= 2 * restarted
    published = [e.step for e in events if isinstance(e, Checkpoint) and e.tier == "durable"]
    assert published and latest_checkpoint(run).name == step_dir_name(published[-1])
    verify_checkpoint(latest_checkpoint(run))


def test_async_checkpoint_equals_state_at_its_step(baseline_60: Path, sync_resumed_60: Path) -> None:
    """The async run keeps training while its step-40 checkpoint is written; the sync run's step-40
    checkpoint is the state at that step (same deterministic trajectory)."""
    async_ckpt = read_full_state(baseline_60 / CHECKPOINTS / "step_000040")
    assert_same_tensors(async_ckpt, read_full_state(sync_resumed_60 / CHECKPOINTS / "step_000040"))
    modes = {e.mode for e in read_events(baseline_60) if isinstance(e, Checkpoint)}
    assert modes == {"async"}


def test_sigkill_during_background_write_never_publishes_it(data_dir: Path, tmp_path: Path) -> None:
    """Rank 1 is killed right after handing its step-10 write to the background worker: the write
    is never finalized, so never published, and the job resumes from step 5."""
    run = tmp_path / "run"
    train(
        data_dir, run, "--steps", "14", "--ckpt-every", "5", "--local-ckpt-every", "0", "--fault", "sigkill@10/write:1"
    )
    events = read_events(run)
    (restart,) = restarts(run)
    # Rank 0 may log step 5's publication just after rank 1's fault: with the save plan cached,
    # nothing in step 10's save waits for rank 0 before rank 1 hands its write off.
    assert [e.step for e in events if isinstance(e, Checkpoint) and e.time < restart.time] == [5]
    assert restart.layer == "in_job" and restart.resumed_from_step == 5
    for path in (run / CHECKPOINTS).glob("step_*"):
        assert ".tmp" not in path.name
        verify_checkpoint(path)
    assert torch.isfinite(torch.tensor(list(losses(run).values()))).all()


# ------------------------------------------------------------------ a soft fault in every save phase
# One run puts an exception in each phase of an async save, on each rank: 8 saves of the 60-step
# reference trajectory (every 5 steps), each hit once. Runs alternate between a machine whose
# cores are all taken by busy loops (steps then fall behind the writer), the harder case, which
# `make test` runs once, and a quiet one. `make stress` repeats it more (RFSDP_STRESS_REPEAT).
PHASE_FAULTS = ",".join(f"exception@{5 * (i + 1)}/{phase}:{i % 2}" for i, phase in enumerate(SAVE_PHASES * 2))
REPEAT = int(os.environ.get("RFSDP_STRESS_REPEAT", "1"))  # one run, beside CPU hogs


@pytest.fixture
def cpu_hogs(repeat: int) -> Iterator[int]:
    """Every other repetition, the first included: one busy-looping process per core while the test runs."""
    count = (os.cpu_count() or 1) if repeat % 2 == 0 else 0
    with busy_loops(count):
        yield count


@pytest.mark.stress
@pytest.mark.parametrize("repeat", range(REPEAT))
def test_soft_fault_in_every_save_phase_recovers_in_process(
    data_dir: Path, baseline_60: Path, tmp_path: Path, cpu_hogs: int
) -> None:
    run = tmp_path / "run"
    faults = ("--fault", PHASE_FAULTS, "--max-inprocess-restarts", "8")
    train(
        data_dir, run, "--steps", "60", "--ckpt-every", "5", "--local-ckpt-every", "0", *faults, timeout=900
    )  # the durable tier's saves
    events = read_events(run)
    fired = [(e.step, e.phase, e.rank) for e in events if isinstance(e, FaultFired)]
    assert fired == [(5 * (i + 1), phase, i % 2) for i, phase in enumerate(SAVE_PHASES * 2)]
    assert [r.layer for r in restarts(run)] == ["in_process"] * len(fired), "a soft fault escalated"
    assert not [e for e in events if isinstance(e, CheckpointFailed)]
    # Each recovery resumes from the save before the one it hit: that one was never published.
    assert [r.resumed_from_step for r in restarts(run)] == [step - 5 for step, _, _ in fired]
    assert losses(run) == losses(baseline_60)
    assert latest_checkpoint(run).name == step_dir_name(60)
    verify_checkpoint(latest_checkpoint(run))


def test_a_lost_final_save_fails_the_run_and_run_end_says_what_was_saved(data_dir: Path, tmp_path: Path) -> None:
    """The last step's save is deleted while it is written (``lose-save``): with no restart left
    the run is no ``completed`` run (before, ``run_end completed`` came without the checkpoint and
    ``rfsdp train`` exited 0); with restarts, the job redoes the steps since step 5 and saves again,
    and ``run_end`` names the checkpoint it ends with."""
    fault = ("--steps", "10", "--ckpt-every", "5", "--fault", "lose-save@10/write")
    failed = tmp_path / "no-restarts"
    proc = train(data_dir, failed, *fault, "--max-restarts", "0", "--max-inprocess-restarts", "0", check=False)
    assert proc.returncode != 0, proc.stderr[-2000:]
    events = read_events(failed)
    assert [e.step for e in events if isinstance(e, CheckpointFailed)] == [10]
    assert [e.status for e in events if isinstance(e, RunEnd)] == ["failed"]
    assert latest_checkpoint(failed).name == step_dir_name(5)

    retried = tmp_path / "with-restarts"
    train(data_dir, retried, *fault)
    events = read_events(retried)
    assert [e.step for e in events if isinstance(e, CheckpointFailed)] == [10]
    (end,) = [e for e in events if isinstance(e, RunEnd)]
    assert (end.status, end.step, end.saved_step) == ("completed", 10, 10)
    assert latest_checkpoint(retried).name == step_dir_name(10)
