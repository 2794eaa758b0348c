"""Fast checks of config, fault specs, data and the events contract (no processes)."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.data.loader import TokenLoader
from trainer.data.shards import (
    DataError,
    decode,
    encode,
    load_manifest,
    load_split,
    prepare_tokens,
    verify_shards,
)
from trainer.events import (
    Checkpoint,
    EventLog,
    FaultFired,
    Restart,
    RunEnd,
    RunStart,
    Step,
    final_losses,
    parse_event_lines,
    read_events,
    to_record,
)
from trainer.faults import parse_fault_spec
from trainer.launch.local import STORE_PORT_SPAN, STORE_PORTS, check_launch, free_port, free_port_base
from trainer.launch.spec import LaunchSpec
from trainer.rank.config import Timeouts, TrainConfig
from trainer.rank.recovery import RunHistory, describe_restart, read_history
from trainer.rank.train import lr_at


def cfg(**kw) -> TrainConfig:
    return TrainConfig(data="d", run_dir="r", **kw)


@pytest.mark.parametrize(
    ("kw", "names"),
    [
        ({"model": "huge"}, "--model"),
        ({"steps": 0}, "--steps"),
        ({"ckpt_every": -1}, "--ckpt-every"),
        ({"ckpt_mode": "later"}, "--ckpt-mode"),
        ({"stop_at_step": 99}, "--stop-at-step"),
        ({"fault": "explode@3"}, "--fault"),
        ({"fault": "exception@999"}, "--fault"),
        ({"fault": "sigkill@3:5"}, "--fault"),
        ({"fault": "sigkill-3"}, "--fault"),
        ({"max_inprocess_restarts": -1}, "--max-inprocess-restarts"),
        (
            {"fault": "exception@10/commit"},
            "--fault: 'exception@10/commit': /PHASE is one of stage, plan, write, finalize",
        ),
        (
            {"fault": "exception@7/write"},
            "--fault: exception@7/write:0 fires inside a save, but step 7 has no async save",
        ),
        ({"fault": "exception@10/write", "ckpt_mode": "sync"}, "step 10 has no async save"),
        ({"fault": "node-loss@10/write:1"}, "--fault"),
        ({"grace_period": 1.0}, "--grace-period: must be at least 5 s"),
        (
            {"fault": "exception@10:1,sigkill@10:0"},
            "--fault: exception@10:1 and sigkill@10:0 are both at step 10: one fault per step",
        ),
        ({"log_every": -1}, "--log-every: must be at least 0"),
        ({"system_metrics_every": 0.5}, "--system-metrics-every: must be 0 \\(off\\) or at least 1 s, got 0.5"),
        ({"system_metrics_every": -1.0}, "--system-metrics-every"),
    ],
)
def test_bad_config_names_the_parameter(kw: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        cfg(**kw)


def test_fault_spec_grammar() -> None:
    faults = parse_fault_spec(
        "exception@5:1, sigkill@9,hang@12:0,exit@20:1,exception@10/finalize:1,sigterm@25:1", steps=30, world_size=2
    )
    assert [(f.kind, f.step, f.rank, f.phase) for f in faults] == [
        ("exception", 5, 1, ""),
        ("sigkill", 9, 0, ""),
        ("hang", 12, 0, ""),
        ("exit", 20, 1, ""),
        ("exception", 10, 1, "finalize"),
        ("sigterm", 25, 1, ""),
    ]
    assert faults[4].key == "exception@10/finalize:1"


@pytest.mark.parametrize("hang", [5, 7.5, 10, 600])
def test_timeouts_keep_their_order(hang: float) -> None:
    t = Timeouts(hang, inprocess=True)
    assert t.collective < t.soft < t.heartbeat < t.hard < t.barrier < t.initial_heartbeat
    # A lost node is found by the wrapper's heartbeat, not waited out by the rank monitor's.
    assert t.wrapper_heartbeat < t.heartbeat and t.wrapper_heartbeat < t.barrier


@pytest.mark.parametrize("hang", [5, 7.5, 10, 600])
def test_the_inprocess_wrapper_accepts_every_allowed_hang_timeout(hang: float) -> None:
    """NVRx checks its timeouts' order when the wrapper is made, in every rank after launch: the
    smallest hang timeout ``rfsdp train`` accepts (5 s) once failed there, its wrapper heartbeat
    timeout (NVRx's default 30 s) equal to the barrier timeout.
    """
    from nvidia_resiliency_ext import inprocess

    from trainer.rank.resilience import wrapper_timeouts

    inprocess.Wrapper(**wrapper_timeouts(Timeouts(hang, inprocess=True)))


def test_config_round_trips_through_argv() -> None:
    import argparse

    from trainer.rank.config import add_train_arguments

    original = cfg(fault="exception@3:1", inprocess_restart=False, ckpt_mode="sync")
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    assert TrainConfig.from_mapping(vars(parser.parse_args(original.to_argv()))) == original


def test_lr_schedule_warms_up_then_decays() -> None:
    c = cfg(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(c, 5) == pytest.approx(0.5)
    assert lr_at(c, 10) == pytest.approx(1.0)
    assert lr_at(c, 100) == pytest.approx(0.1)
    assert lr_at(c, 50) > lr_at(c, 80)


def test_tokenizer_round_trip() -> None:
    text = "naïve café ✓"
    assert decode(encode(text)) == text


def test_prepare_and_verify(tmp_path: Path) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 2000
    manifest = prepare_tokens(text, tmp_path, shard_tokens=20_000)
    assert manifest["splits"]["train"]["tokens"] + manifest["splits"]["val"]["tokens"] == len(text)
    assert len(manifest["splits"]["train"]["shards"]) > 1
    verify_shards(tmp_path, load_manifest(tmp_path))
    assert decode(load_split(tmp_path, "train")[:9]) == "The quick"

    shard = tmp_path / manifest["splits"]["train"]["shards"][1]["file"]
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="checksum"):
        verify_shards(tmp_path, manifest)
    shard.write_bytes(bytes(raw[:-10]))
    with pytest.raises(DataError, match="wrong size"):
        verify_shards(tmp_path, manifest)
    shard.unlink()
    with pytest.raises(DataError, match="missing"):
        verify_shards(tmp_path, manifest)


def test_loader_shards_by_rank_and_resumes_from_its_position() -> None:
    tokens = np.arange(50_000, dtype=np.uint16) % 256
    r0, r1 = (TokenLoader(tokens, 16, 4, rank, 2) for rank in (0, 1))
    a0, _ = r0.next_batch()
    a1, _ = r1.next_batch()
    assert not np.array_equal(a0.numpy(), a1.numpy())
    r0.next_batch()
    state = r0.state_dict()
    expected, _ = r0.next_batch()
    fresh = TokenLoader(tokens, 16, 4, 0, 2)
    fresh.load_state_dict(state)
    assert np.array_equal(fresh.next_batch()[0].numpy(), expected.numpy())


def test_describe_restart_measures_from_the_fault() -> None:
    prior = [
        RunStart(time=0.0, config={}, resumed_from_step=0, world_size=2),
        *(Step(time=float(s), step=s, loss=1.0, step_time_s=0.5) for s in range(1, 15)),
        FaultFired(time=14.5, kind="exception", step=15),
    ]
    first = Step(time=20.0, step=11, loss=1.0, step_time_s=0.5)
    marks = {"imports_done": 3.0, "process_group": 16.0, "resumed": 18.0}  # a process that outlived the fault
    r = describe_restart(RunHistory.of(prior), layer="in_process", resumed_from=10, first_step=first, marks=marks)
    phases = {"process_group": 1.5, "resumed": 3.5, "first_step": 5.5}
    assert r == Restart(
        layer="in_process", attempt=1, resumed_from_step=10, lost_steps=4, recovery_s=5.5, phases=phases
    )


def test_recovery_is_measured_on_the_clock_of_the_host_that_saw_it_end() -> None:
    """The fault's host runs 100 s ahead: its time is not subtracted from the first step's; the
    last step the first step's host completed before the fault is used instead."""
    steps = [Step(time=float(s), host="node-0", step=s, loss=1.0, step_time_s=0.5) for s in range(1, 15)]
    fault = FaultFired(time=114.5, host="node-1", rank=1, kind="sigkill", step=15)
    first = Step(time=20.0, host="node-0", step=11, loss=1.0, step_time_s=0.5)
    prior = [RunStart(time=0.0, host="node-0", config={}, resumed_from_step=0, world_size=2), *steps, fault]
    assert (
        describe_restart(RunHistory.of(prior), layer="in_job", resumed_from=10, first_step=first).recovery_s
        == 20.0 - 14.0
    )
    same_host = dataclasses.replace(fault, time=14.5, host="node-0")
    assert (
        describe_restart(
            RunHistory.of([*prior[:-1], same_host]), layer="in_job", resumed_from=10, first_step=first
        ).recovery_s
        == 5.5
    )


def test_torn_event_lines_are_skipped() -> None:
    """A writer killed mid-line leaves a partial line; the next writer's line, glued to it by an
    older writer, is still read (the last place an event begins on the line)."""
    line = '{{"event": "step", "step": {}, "loss": 1.0, "step_time_s": 0.1}}'
    text = f"{line.format(1)}\n{line.format(2)[:20]}{line.format(2)}\n{line.format(3)[:30]}\n"
    assert [e.step for e in parse_event_lines(text)] == [1, 2]


def test_final_losses_take_the_last_line() -> None:
    events = [Step(step=1, loss=2.0, step_time_s=0.1), Step(step=1, loss=1.5, step_time_s=0.1)]
    assert final_losses(events) == {1: 1.5}


def test_a_second_fault_before_the_first_ones_step_counts_only_its_own_lost_steps() -> None:
    """Faults at step 27 and, after resuming from 20, at step 23: the second restart redoes 21-22,
    not 21-27 again (the steps each restart counts are the steps run more than once)."""
    step = partial(Step, loss=1.0, step_time_s=0.1)
    first_attempt = [RunStart(config={}, resumed_from_step=0, world_size=2), *(step(step=s) for s in range(1, 28))]
    fault = FaultFired(kind="sigkill", step=28)
    restarted = [
        step(step=21),
        Restart(layer="in_job", attempt=1, resumed_from_step=20, lost_steps=7, recovery_s=1.0),
        step(step=22),
    ]
    history = RunHistory.of([*first_attempt, fault])
    assert describe_restart(history, layer="in_job", resumed_from=20, first_step=step(step=21)).lost_steps == 7
    history = RunHistory.of([*first_attempt, fault, *restarted, fault])
    assert describe_restart(history, layer="in_job", resumed_from=20, first_step=step(step=21)).lost_steps == 2


def test_launch_refuses_bad_input_before_starting(tmp_path: Path, data_dir: Path) -> None:
    with pytest.raises(ValueError, match="--data"):
        check_launch(TrainConfig(data=str(tmp_path / "nope"), run_dir=str(tmp_path / "r")), LaunchSpec())
    with pytest.raises(ValueError, match="--nproc-per-node"):
        LaunchSpec(nproc_per_node=0)
    with pytest.raises(ValueError, match="does not fit"):
        check_launch(
            TrainConfig(data=str(data_dir), run_dir=str(tmp_path / "r"), world_size=512), LaunchSpec(nproc_per_node=512)
        )
    run = tmp_path / "other"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": "small", "seed": 0}))
    with pytest.raises(ValueError, match="another training config"):
        check_launch(TrainConfig(data=str(data_dir), run_dir=str(run)), LaunchSpec())


def test_recovery_layer() -> None:
    from trainer.rank.recovery import recovery_layer

    crashed = [RunStart(config={}, resumed_from_step=0, world_size=2), Step(step=1, loss=1.0, step_time_s=0.1)]
    finished = [*crashed, RunEnd(status="stopped")]
    crashed, finished = RunHistory.of(crashed), RunHistory.of(finished)
    assert recovery_layer(crashed, in_process_attempt=1, in_job_restart=0) == "in_process"
    assert recovery_layer(finished, in_process_attempt=0, in_job_restart=2) == "in_job"
    assert recovery_layer(crashed, in_process_attempt=0, in_job_restart=0) == "in_job"  # a replaced replica
    assert recovery_layer(finished, in_process_attempt=0, in_job_restart=0) is None  # a deliberate resume
    assert recovery_layer(RunHistory(), in_process_attempt=0, in_job_restart=0) is None


def test_a_run_history_keeps_what_a_restart_needs_and_reads_only_its_kinds(tmp_path: Path) -> None:
    """The history folded from the file equals the one folded from every event, torn lines and
    lines of kinds it skips unparsed included; a fault counts only until the next (re)start."""
    step = partial(Step, loss=1.0, step_time_s=0.1, host="h0")
    ckpt = partial(Checkpoint, mode="async", blocking_s=0.01, total_s=0.1, bytes=1, tier="local")
    events = [
        RunStart(time=0.0, config={}, resumed_from_step=0, world_size=2),
        step(time=1.0, step=1),
        ckpt(time=1.1, step=1),
        step(time=2.0, step=2),
        FaultFired(time=2.5, kind="exception", step=3, host="h1"),
        step(time=2.6, step=3),  # completed after the fault, before the restart
        FaultFired(time=2.7, kind="sigkill", step=4, host="h1"),
        Restart(time=4.0, layer="in_job", attempt=1, resumed_from_step=1, lost_steps=2, recovery_s=1.5),
        step(time=5.0, step=2),
        RunEnd(time=6.0, status="stopped", step=2),
        RunStart(time=10.0, config={}, resumed_from_step=2, world_size=2),
        step(time=11.0, step=3),
        step(time=12.0, step=4),
        FaultFired(time=12.5, kind="sigkill", step=5, host="h1"),
        step(time=12.6, step=5),
    ]
    lines = [json.dumps(to_record(e)) + "\n" for e in events]  # as EventLog writes them, with these times and hosts
    lines[2:4] = [lines[2][:30] + lines[3]]  # a checkpoint line torn by its killed writer, the next line (a step) on it
    (tmp_path / "events.jsonl").write_text("".join(lines) + "not json\n")
    written = read_events(tmp_path)
    at = {e.time: e for e in written}
    assert 1.1 not in at and 2.0 in at  # the torn checkpoint is lost; the step glued to it is read, by every reader

    history = read_history(tmp_path)
    assert history == RunHistory.of(written)
    assert (history.restarts, history.restarts_in_session, history.session_open, history.max_step) == (1, 0, True, 5)
    assert history.fault == at[12.5] and history.last_step_time_before_fault == {"h0": 12.0}
    assert read_events(tmp_path, [Restart, RunEnd]) == [e for e in written if isinstance(e, Restart | RunEnd)]

    # The first session: of its two faults the later counts, and the step completed after it does not.
    first = RunHistory.of(e for e in written if e.time <= 2.7)
    assert first.fault == at[2.7] and first.last_step_time_before_fault == {"h0": 2.6}
    assert RunHistory.of(e for e in written if e.time <= 5.0).fault is None  # the restart ended it
    restart = describe_restart(first, layer="in_job", resumed_from=1, first_step=step(time=4.0, step=2))
    assert (restart.attempt, restart.lost_steps, restart.recovery_s) == (1, 2, 4.0 - 2.6)


def test_the_async_writer_refuses_an_nvrx_whose_internals_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's own guard, for a run on an NVRx other than the one pinned above: it passes on
    that one, and refuses one whose worker loop takes other arguments as the writer is made,
    naming both versions, where the worker would have died in the background at the first save."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import PersistentAsyncCaller

    from trainer.errors import NonTransientError
    from trainer.rank.resilience import AsyncCheckpointWriter
    from trainer.rank.resilience.async_writer import check_nvrx_internals

    check_nvrx_internals()
    monkeypatch.setattr(PersistentAsyncCaller, "async_loop", staticmethod(lambda rank, queue, preload_q, comp_q: None))
    monkeypatch.delattr(filesystem_async, "_results_queue")
    refused = (
        r"nvidia-resiliency-ext \S+ is not what .* checked against "
        r"\(0\.4\.1\): .*PersistentAsyncCaller\.async_loop\(rank, "
    )
    with pytest.raises(NonTransientError, match=refused + r".*filesystem_async\._results_queue"):
        AsyncCheckpointWriter(cuda=False)


def test_validation_replays_never_touch_the_runs_mirror_or_faults(tmp_path: Path, data_dir: Path) -> None:
    from trainer.results.validate import run_config

    recorded = cfg(fault="exception@5:1", checkpoint_uri="s3://production/run", stop_at_step=30).to_dict()
    EventLog(tmp_path, 0).emit(RunStart(config=recorded, resumed_from_step=0, world_size=2))
    replay = run_config(tmp_path, data_dir)
    assert (replay.checkpoint_uri, replay.fault, replay.stop_at_step) == ("", "", 0)
    assert (
        replay.trajectory_hash()
        == cfg(**{k: v for k, v in recorded.items() if k not in ("data", "run_dir")}).trajectory_hash()
    )


def test_store_and_rendezvous_ports_are_free_and_outside_the_ephemeral_range() -> None:
    import socket

    low, _high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    base = free_port_base()
    assert base + STORE_PORT_SPAN <= low  # an outgoing connection can never take a store's port
    with socket.socket() as s:  # the block's ends are bindable
        s.bind(("127.0.0.1", base))
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + STORE_PORT_SPAN - 1))
    ports = {free_port() for _ in range(20)}
    assert max(ports) < low and len(ports) > 1  # nor another process's port 0 (a gloo listener)
    assert min(ports) >= STORE_PORTS[1] > base + STORE_PORT_SPAN  # nor a port of another job's store block


def test_a_port_an_earlier_connection_holds_in_time_wait_counts_as_free() -> None:
    """The stores bind with SO_REUSEADDR, so a port in TIME_WAIT is theirs to take; a port that
    something listens on is not free."""
    import datetime
    import socket

    from torch.distributed import TCPStore

    from trainer.launch.local import _port_free

    port = free_port_base(1)
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        assert not _port_free(port)
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: its port goes to TIME_WAIT
            time.sleep(0.05)
    with socket.socket() as plain, pytest.raises(OSError):  # what the check did without SO_REUSEADDR
        plain.bind(("127.0.0.1", port))
    assert _port_free(port)
    store = TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=5))  # as a store takes it
    store.set("k", "v")
    del store


def test_a_rank_writes_each_line_of_its_stderr_in_one_piece() -> None:
    """Ranks share their launcher's log: print's text and its newline must leave in one write."""
    import io

    from trainer.rank.train import write_lines_whole

    class Writes(io.RawIOBase):
        def __init__(self) -> None:
            self.calls: list[bytes] = []

        def writable(self) -> bool:
            return True

        def write(self, b: bytes) -> int:
            self.calls.append(bytes(b))
            return len(b)

    raw = Writes()
    stderr = io.TextIOWrapper(raw, write_through=True)  # as Python's own stderr
    print("rank 0: one", file=stderr)
    assert raw.calls == [b"rank 0: one", b"\n"]  # what interleaved with another rank's line
    write_lines_whole(stderr)
    print("rank 0: two", file=stderr)
    print("rank 0:", "three", file=stderr)
    stderr.write("Traceback ...\n  two lines\n")  # a text that ends its last line: one write too
    assert raw.calls[2:] == [b"rank 0: two\n", b"rank 0: three\n", b"Traceback ...\n  two lines\n"]


def test_run_dir_lock_refuses_a_second_holder_and_takes_over_a_stale_one(tmp_path: Path) -> None:
    import os

    from trainer.errors import ParameterError
    from trainer.launch.local import RUN_DIR_LOCK, hold_run_dir

    run = tmp_path / "run"
    busy = rf"^--run-dir: {run} is in use by a live job \(pid {os.getpid()} on "
    with hold_run_dir(run), pytest.raises(ParameterError, match=busy), hold_run_dir(run):
        pass
    (run / RUN_DIR_LOCK).write_text(
        "pid 1 on a-host-that-died since yesterday\n"
    )  # a holder that died: nothing holds the lock
    with hold_run_dir(run):
        assert f"pid {os.getpid()} on " in (run / RUN_DIR_LOCK).read_text()


def test_errors_no_restart_can_fix_are_found_in_the_chain(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from trainer.checkpoint import CheckpointWriteError
    from trainer.errors import non_transient_cause
    from trainer.rank.resilience import _read_outcome, _write_shard

    def write_to_full_disk(rank: int, buckets: list, results: object) -> None:
        with open("/dev/full", "wb", buffering=0) as f:  # the kernel's ENOSPC
            f.write(b"shard")

    # A background write that meets a full disk reports its errno; the training process gets an OSError back.
    done = torch.zeros(1, dtype=torch.int64)
    _write_shard(done, 7, None, 0, write_to_full_disk, str(tmp_path), 0, [])  # (no copy to wait for)
    assert int(done[0]) == 7
    with pytest.raises(OSError) as caught:
        _read_outcome(tmp_path, 0)
    assert caught.value.errno == errno.ENOSPC and non_transient_cause(caught.value) is caught.value

    disk_full = OSError(errno.ENOSPC, "No space left on device")
    try:
        raise CheckpointWriteError("background write failed") from disk_full
    except CheckpointWriteError as e:
        assert non_transient_cause(e) is disk_full
    dcp_failure = CheckpointException("save failed", {1: (disk_full, None)})  # how DCP reports a rank's failure
    assert non_transient_cause(dcp_failure) is disk_full
    assert isinstance(non_transient_cause(DataError("shard train_000.bin fails its checksum")), DataError)
    assert non_transient_cause(OSError(errno.ECONNRESET, "peer gone")) is None  # a restart helps there
    assert non_transient_cause(CheckpointWriteError("background write failed: on another rank")) is None


def test_a_fatal_error_latches_only_the_launcher_that_saw_it() -> None:
    """Restarted ranks end at once after a fatal error of their job written since their launcher
    started; an older one (a job before a fix, with the same rendezvous id) does not hold them."""
    from trainer.events import Fatal, fatal_error
    from trainer.process import process_start_time

    launcher_started = process_start_time(os.getppid())
    assert launcher_started <= process_start_time() <= time.time()
    old = Fatal(time=launcher_started - 60, error="OSError: [Errno 28] No space left on device", job="none")
    new = dataclasses.replace(old, time=launcher_started + 1, error="DataError: shard fails its checksum")
    assert fatal_error([old], "none", since=launcher_started) is None
    assert fatal_error([old, new], "none", since=launcher_started) == new
    assert fatal_error([old, new], "another-job", since=launcher_started) is None


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_a_config_file_sets_train_options_and_flags_override_it(tmp_path: Path, suffix: str) -> None:
    from trainer.cli import _config_defaults, build_parser

    text = 'steps = 12\nckpt_every = 4\nfault = "exception@6:1"\ninprocess_restart = false\n'
    path = tmp_path / f"run{suffix}"
    path.write_text(text if suffix == ".toml" else text.replace(" = ", ": "))
    argv = ["train", "--config", str(path), "--data", "d", "--run-dir", "r", "--steps", "10"]
    parser = build_parser()
    _config_defaults(parser, "train", path)
    args = parser.parse_args(argv)
    assert (args.steps, args.ckpt_every, args.fault, args.inprocess_restart) == (10, 4, "exception@6:1", False)
    assert TrainConfig.from_mapping({**vars(args), "world_size": 2}).ckpt_every == 4

    path.write_text("stepz = 3\n" if suffix == ".toml" else "stepz: 3\n")
    known = r"\(known: activation_checkpointing, batch_size"
    with pytest.raises(ValueError, match=r"--config: unknown key 'stepz' in .*run\.(toml|yaml) " + known):
        _config_defaults(build_parser(), "train", path)
    path.write_text("inprocess_restart = 3\n" if suffix == ".toml" else "inprocess_restart: 3\n")
    with pytest.raises(ValueError, match="inprocess_restart in .* must be true or false"):
        _config_defaults(build_parser(), "train", path)


def test_a_store_client_connects_once_its_server_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's store client waits for rank 0's server to listen before connecting (c10d's
    client, coming first, retries only half a second later). The wait returns only once the
    server listens, and at its timeout when nothing does; an attempt's store (rank 1) uses it,
    and c10d's server works after the probe."""
    import datetime
    import socket
    import threading

    import torch.distributed as dist

    from trainer.rank import connections

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listening_since: list[float] = []

        def listen_later() -> None:
            time.sleep(0.3)
            listening_since.append(time.monotonic())
            listener.listen()

        threading.Thread(target=listen_later).start()
        connections.wait_until_listening("127.0.0.1", port, 30)
        assert listening_since and time.monotonic() >= listening_since[0]
    connections.wait_until_listening("127.0.0.1", port, 0.2)  # nothing listens: returns, raising nothing

    waited: list[tuple[str, int]] = []
    wait = connections.wait_until_listening

    def recorded_wait(host: str, port: int, timeout_s: float) -> None:
        waited.append((host, port))
        wait(host, port, timeout_s)

    monkeypatch.setattr(connections, "wait_until_listening", recorded_wait)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    served: list[dist.TCPStore] = []

    def serve() -> None:
        served.append(
            dist.TCPStore(
                "127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=30), wait_for_workers=True
            )
        )
        served[0].set("from rank 0", "hello")

    server = threading.Thread(target=serve)
    server.start()
    client = connections.make_store(connections.Attempt(store_port=port), 30)
    server.join()
    assert waited == [("127.0.0.1", port)] and client.get("from rank 0") == b"hello"


def test_an_abort_cuts_only_the_connections_made_while_recording() -> None:
    """What an in-process restart's abort shuts down: the internet connections opened while the
    attempt's groups were made. Not their listening sockets (gloo ends the process if its listener
    fails), not a Unix socket (ft_launcher's monitor), not what was opened before or after, not
    a descriptor whose number was reused, and neither end of a connection on a spared port (the
    wrapper's store: rank 0 hosts it, and a peer's monitor process may connect while it records)."""
    import socket

    from trainer.rank.resilience import CollectiveConnections

    server = socket.create_server(("127.0.0.1", 0))
    address = server.getsockname()
    before = socket.create_connection(address)
    wrapper_store = socket.create_server(("127.0.0.1", 0))
    connections = CollectiveConnections(spared_ports=frozenset({wrapper_store.getsockname()[1]}))
    with connections.recording():
        made = socket.create_connection(address)
        gone = socket.create_connection(address)
        listener = socket.create_server(("127.0.0.1", 0))
        unix, unix_peer = socket.socketpair()
        to_store = socket.create_connection(wrapper_store.getsockname())  # a client: the peer's port is spared
        accepted = wrapper_store.accept()[0]  # the server's end: its own port is
    before_peer, made_peer, gone_peer = (server.accept()[0] for _ in range(3))
    other = socket.create_connection(address)
    reused = socket.socket(fileno=os.dup2(other.fileno(), gone.detach()))  # another socket at gone's number
    other_peer = server.accept()[0]

    assert connections.cut() == 1
    assert made.recv(1) == b"" and made_peer.recv(1) == b""  # shut down: both ends see the end of the stream
    to_listener = socket.create_connection(listener.getsockname())
    for end, peer in [
        (before, before_peer),
        (reused, other_peer),
        (unix, unix_peer),
        (to_listener, listener.accept()[0]),
        (to_store, accepted),
        (accepted, to_store),
    ]:
        end.sendall(b"x")
        assert peer.recv(1) == b"x"
    assert connections.cut() == 0  # each attempt's connections are cut once
    for s in (
        server,
        before,
        made,
        listener,
        unix,
        unix_peer,
        before_peer,
        made_peer,
        gone_peer,
        other,
        reused,
        other_peer,
        to_listener,
        wrapper_store,
        to_store,
        accepted,
    ):
        s.close()


def test_an_earlier_jobs_fatal_never_matches_a_new_job_with_the_same_pid(tmp_path: Path) -> None:
    """The job id was ``rfsdp-PID``: a later job whose launcher got the same pid read an earlier
    job's ``fatal`` as its own and ended at its first failure instead of restarting. The id now
    holds the launcher's start too (real events, this process's real start)."""
    from trainer.events import EventLog, Fatal, fatal_error, read_events
    from trainer.launch.local import job_id
    from trainer.process import process_start_ticks

    now = job_id()
    assert now == f"rfsdp-{os.getpid()}-{process_start_ticks()}"
    EventLog(tmp_path, 0).emit(
        Fatal(error="earlier", job=f"rfsdp-{os.getpid()}-{process_start_ticks() - 100}")
    )  # same pid, earlier start
    EventLog(tmp_path, 0).emit(Fatal(error="old format", job=f"rfsdp-{os.getpid()}"))  # an id of the old form
    assert fatal_error(read_events(tmp_path), now) is None
    EventLog(tmp_path, 1).emit(Fatal(error="this job", job=now))
    assert fatal_error(read_events(tmp_path), now).error == "this job"


def test_create_text_makes_one_file_whole_of_several_writers(tmp_path: Path) -> None:
    """A run's identity is recorded once: of two launches racing to record theirs, the first
    wins whole and the second learns it lost (and is then refused if its identity differs)."""
    from trainer.fsutil import create_text

    path = tmp_path / "config.json"
    assert create_text(path, "first")
    assert not create_text(path, "second")
    assert path.read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # no temporary file left


def test_sync_tree_copies_only_what_differs_and_never_truncates_a_file_being_read(tmp_path: Path) -> None:
    """A retried train step copies the data again while its job may still read it (mapped)."""
    import mmap

    from trainer.fsutil import sync_tree

    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "shards").mkdir(parents=True)
    (src / "shards" / "a.bin").write_bytes(b"a" * 4096)
    (src / "manifest.json").write_text("{}")
    assert sync_tree(src, dst) == 2 and sync_tree(src, dst) == 0  # a second pass copies nothing
    with open(dst / "shards" / "a.bin", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        (src / "shards" / "a.bin").write_bytes(b"b" * 8192)
        assert sync_tree(src, dst) == 1
        assert mapped[:] == b"a" * 4096  # the reader's file is whole (a truncation would SIGBUS here)
    assert (dst / "shards" / "a.bin").read_bytes() == b"b" * 8192
    assert not [p for p in dst.rglob(".*tmp*")]


def test_a_forked_process_exits_with_the_code_the_interpreter_would(capsys: pytest.CaptureFixture) -> None:
    from trainer.process import exit_code

    assert [exit_code(SystemExit(code)) for code in (None, 0, 3)] == [0, 0, 3]
    assert exit_code(SystemExit("no restart can fix this")) == 1
    assert capsys.readouterr().err == "no restart can fix this\n"
