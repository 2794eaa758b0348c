"""The NVRx writer's life cycle across attempts (its real background worker, forked from the
rank), on the policy and fake writer of tests/unit/test_checkpointer.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import ROOT
from tests.unit import test_checkpointer
from tests.unit.test_checkpointer import checkpointer, new_group, saved
from trainer.checkpoint import (
    SaveHooks,
    latest_checkpoint,
    step_dir_name,
    verify_checkpoint,
)
from trainer.events import Checkpoint, read_events, select

one_rank = test_checkpointer.one_rank  # a fixture of the unit tests'


# ------------------------------------------------------------------ the real NVRx writer
def test_async_writer_never_finalizes_an_earlier_attempts_write(one_rank: None, tmp_path: Path) -> None:
    """A fault ends an attempt with its save in flight and no cleanup run (in-process restart
    raises anywhere): the next attempt's group abandons that write, waits for the worker, and
    its own saves publish."""
    from trainer.rank.resilience import AsyncCheckpointWriter

    writer = AsyncCheckpointWriter(cuda=False)
    try:
        tensors = {"w": torch.arange(1 << 16, dtype=torch.float32)}
        first = checkpointer(tmp_path, writer, every=1)
        first.save(1, lambda: ({"model": tensors}, {"step": 1}))  # in flight: never polled again
        abandoned = first.pending.tmp_dir
        second = checkpointer(tmp_path, writer, every=1)
        second.save(2, lambda: ({"model": tensors}, {"step": 2}))
        second.finish()
        assert saved(tmp_path) == [2]
        assert not (abandoned / ".metadata").exists(), "the abandoned write was finalized"
        verify_checkpoint(latest_checkpoint(tmp_path), world_size=1)
        assert latest_checkpoint(tmp_path).name == step_dir_name(2)
    finally:
        writer.close()


def test_a_prepared_async_writer_saves_first_with_the_cached_plan(one_rank: None, tmp_path: Path) -> None:
    """Its staging buffers exist and DCP's plan is cached before the first save, which then
    plans without the collective, as every later save does; the checkpoint is whole."""
    from trainer.rank.resilience import AsyncCheckpointWriter

    writer = AsyncCheckpointWriter(cuda=False)
    try:
        tensors = {"w": torch.arange(1 << 16, dtype=torch.float32)}
        ckpt = checkpointer(tmp_path, writer, every=2)
        ckpt.step(1, lambda: ({"model": tensors}, {"step": 1}), last=False)
        current = writer._current
        assert current.staging is not None and current.plans.validated_cache_reuse
        ckpt.step(2, lambda: ({"model": tensors}, {"step": 2}), last=True)
        verify_checkpoint(latest_checkpoint(tmp_path), world_size=1)
        assert not list((tmp_path / "checkpoints").glob("prepare*")), "the plan-only scratch dir was left"
    finally:
        writer.close()


def test_an_async_save_copies_the_state_beside_the_next_step_and_writes_it_as_it_was(
    one_rank: None, tmp_path: Path
) -> None:
    """The copy into the staging buffers runs on a thread of its own once the save returns (the
    next step's forward and backward only read the state); ``before_update`` waits for it before
    the optimizer changes the state, and that wait counts in the save's stall. The checkpoint holds
    the state as it was at the save, and its event shows the copy and the wait after ``handoff``."""
    from trainer.rank.resilience import AsyncCheckpointWriter, _BackgroundCopy

    writer = AsyncCheckpointWriter(cuda=False)
    try:
        live = {"w": torch.arange(1 << 22, dtype=torch.float32), "b": torch.ones(8)}
        hyper = {"lr": 0.25}
        ckpt = checkpointer(tmp_path, writer, every=2)
        for step in (1, 2):  # 1 prepares the writer, 2 saves
            ckpt.step(step, lambda step=step: ({"model": live, "optim": dict(hyper)}, {"step": step}), last=False)
        assert isinstance(writer._current.copy, _BackgroundCopy)
        expected = {name: t.clone() for name, t in live.items()}
        ckpt.before_update()
        assert writer._current.copy is None
        for t in live.values():  # the optimizer's update
            t.add_(1)
        hyper["lr"] = 0.5
        ckpt.finish()
        loaded = {"model": {name: torch.zeros_like(t) for name, t in live.items()}, "optim": {"lr": 0.0}}
        dcp.load(loaded, checkpoint_id=latest_checkpoint(tmp_path))
        assert all(torch.equal(loaded["model"][name], t) for name, t in expected.items())
        assert loaded["optim"]["lr"] == 0.25
        (event,) = select(read_events(tmp_path), Checkpoint)
        names = list(event.phases)
        assert names[names.index("handoff") :][:3] == ["handoff", "copy", "copy_wait"] and names[-1] == "publish"
        stall = (
            sum(event.phases[n] for n in names[: names.index("handoff") + 1] if n != "prepare")
            + event.phases["copy_wait"]
        )
        assert event.blocking_s == pytest.approx(stall)
        ckpt.before_update()  # nothing in flight: nothing to wait for
    finally:
        writer.close()


def test_the_async_writer_heartbeats_while_it_makes_its_buffers(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large state's staging buffers take seconds to make (1-2 s for the base model on 2 CPUs):
    the writer calls ``heartbeat`` after each one, so hang detection does not take that for a hang;
    the buffers are shared memory shaped like the state. The ranks then meet (on a group with a
    long timeout) before the planning collective, once per attempt: one rank may be seconds
    later than another. Their plans run on the group given for them (its timeout allows for a
    coordinator that plans for seconds), not on the saves' own."""
    from trainer.rank.resilience import AsyncCheckpointWriter, async_writer

    writer = AsyncCheckpointWriter(cuda=False)
    made: list[int] = []
    planned_on: list[object] = []
    plan = async_writer.save_state_dict_async_plan

    def recording_plan(*args: object, process_group: object, **kwargs: object) -> object:
        planned_on.append(process_group)
        return plan(*args, process_group=process_group, **kwargs)

    monkeypatch.setattr(async_writer, "save_state_dict_async_plan", recording_plan)
    try:
        params = {f"w{i}": torch.full((64,), float(i)) for i in range(4)}
        moments = {name: {"exp_avg": torch.zeros(64), "step": torch.tensor(3.0)} for name in params}
        tensors = {"model": params, "optim": {"state": moments, "param_groups": [{"lr": 0.1, "params": list(params)}]}}
        group = new_group()
        hooks = SaveHooks(heartbeat=lambda: made.append("heartbeat"), meet=lambda: made.append("meet"))
        plan_group = new_group()
        writer.prepare(tensors, tmp_path / "scratch", group, hooks, plan_group=plan_group)
        assert planned_on == [plan_group, plan_group]
        staging = writer._current.staging
        assert made.count("heartbeat") >= len(params) + 2 * len(moments)  # at least once per tensor
        assert made[-1] == "meet" and made.count("meet") == 1  # after the last buffer
        assert writer.poll(group)
        writer.start(tensors, tmp_path / "save", group, hooks)
        assert made.count("meet") == 1  # the buffers are made once per attempt
        assert staging["optim"]["param_groups"] == tensors["optim"]["param_groups"]
        buffers = [*staging["model"].values(), *(m["exp_avg"] for m in staging["optim"]["state"].values())]
        assert all(b.is_shared() and b.shape == (64,) for b in buffers)
    finally:
        writer.close()


def test_async_writer_forks_its_worker_when_created_on_cpu() -> None:
    """On CPU the background worker runs as soon as the writer exists, a fork of the rank (no
    interpreter started, nothing imported again: a restart does not pay for one), at the lowest
    CPU priority while the rank keeps its own, and it ends with close()."""
    from trainer.rank.resilience import AsyncCheckpointWriter

    rank_priority = os.getpriority(os.PRIO_PROCESS, 0)
    writer = AsyncCheckpointWriter(cuda=False)
    try:
        worker = writer._caller.process
        assert worker.is_alive()
        assert Path(f"/proc/{worker.pid}/cmdline").read_bytes() == Path("/proc/self/cmdline").read_bytes()
        deadline = time.monotonic() + 30  # it lowers its priority first thing after the fork
        while os.getpriority(os.PRIO_PROCESS, worker.pid) != 19 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.getpriority(os.PRIO_PROCESS, worker.pid) == 19
        assert os.getpriority(os.PRIO_PROCESS, 0) == rank_priority
    finally:
        writer.close()
    assert not worker.is_alive()


def test_a_rank_killed_with_its_process_group_leaves_no_semaphore_in_dev_shm() -> None:
    """The launcher SIGKILLs a failed rank's whole process group, so nothing of the rank cleans up
    after it: its writer's interprocess queues must leave no file in /dev/shm (the pod's memory,
    which outlives container restarts)."""
    rank = textwrap.dedent("""
        from trainer.rank.resilience import AsyncCheckpointWriter
        writer = AsyncCheckpointWriter(cuda=False)
        print("ready", flush=True)
        input()
    """)
    before = set(Path("/dev/shm").glob("sem.*"))
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    proc = subprocess.Popen([sys.executable, "-c", rank], cwd=ROOT, start_new_session=True, **pipes)
    try:
        assert proc.stdout.readline() == "ready\n"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the rank, its worker and its resource tracker, as the launcher does
        proc.wait()
    assert sorted(p.name for p in set(Path("/dev/shm").glob("sem.*")) - before) == []
