"""The training entry point, run on every rank by ft_launcher (or torchrun).

Example::

    ft_launcher --nproc-per-node 2 -m trainer.rank.train --data DATA --run-dir RUN [--fault exception@20:1]

``rfsdp train`` builds that command for you (see ``trainer.launch.local``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint import (
    CHECKPOINTS,
    Checkpointer,
    CheckpointWriter,
    SyncDcpWriter,
    local_tier_dir,
    private_local_tier_root,
    published_checkpoints,
)
from trainer.data.loader import TokenLoader
from trainer.data.prepare import local_data
from trainer.data.shards import load_split
from trainer.errors import FATAL_EXIT_CODE, ParameterError, non_transient_cause
from trainer.events import (
    EventLog,
    Fatal,
    Restart,
    RunEnd,
    RunStart,
    RunWarning,
    Step,
    fatal_error,
    read_events,
)
from trainer.faults import FaultInjector
from trainer.process import die_with_parent, launcher_pid, leave, process_start_time
from trainer.rank.config import Timeouts, TrainConfig, add_train_arguments, replica_cliques
from trainer.rank.failures import Failures, check_loss, poison_parameters
from trainer.rank.identity import check_run_dir
from trainer.rank.preemption import Preemption
from trainer.rank.recovery import RunHistory, describe_restart, read_history, recovery_layer
from trainer.rank.resilience import (
    AsyncCheckpointWriter,
    Attempt,
    LocalTier,
    RankMonitor,
    make_store,
    replication_groups,
    run_restartable,
)
from trainer.rank.runtime import build_fsdp_model, detect_runtime, init_process_group
from trainer.rank.state import TrainState, resume
from trainer.rank.system import start_system_sampler
from trainer.storage.mirror import CheckpointMirror

IMPORTED_AT = time.time()  # a recovery's timeline: a new process has paid its imports by now


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


HEARTBEAT_EVERY_S = 1.0
"""Least seconds between two heartbeats from within a step or a save."""


def throttled_heartbeat(heartbeat: Callable[[], None]) -> Callable[[], None]:
    """``heartbeat`` (the hang detectors' "this rank makes progress") for calls from within work
    (each block, each buffer, each write): at most once per :data:`HEARTBEAT_EVERY_S`, since each
    costs a socket round trip, and only from the main thread, since ft_launcher's client sends and
    reads its reply on one socket (autograd's backward runs in a thread of its own on CUDA).
    """
    last = -math.inf

    def throttled() -> None:
        nonlocal last
        if threading.current_thread() is threading.main_thread() and time.monotonic() - last >= HEARTBEAT_EVERY_S:
            last = time.monotonic()
            heartbeat()

    return throttled


def heartbeat_within_steps(units: list[torch.nn.Module], heartbeat: Callable[[], None]) -> None:
    """Call ``heartbeat`` (from :func:`throttled_heartbeat`) from within each step too: as each FSDP
    unit's forward ends and as its gradient arrives in backward. A step slower than the hang timeout (a
    large model on CPU) is then not taken for a hang, while a rank stuck in a collective or
    anywhere outside the model still is: the heartbeats stop with it.
    """

    def after_forward(unit: torch.nn.Module, args: tuple, output: object) -> None:
        heartbeat()
        first = output[0] if isinstance(output, tuple | list) else output  # (HF layers return tuples in some versions)
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(lambda grad: heartbeat())  # returns None: the gradient is unchanged

    for unit in units:
        unit.register_forward_hook(after_forward)


def train_step(
    state: TrainState,
    lr: float,
    grad_clip: float,
    device: torch.device,
    *,
    accum: int = 1,
    stop: bool = False,
    wait_for_staging: Callable[[], object] | None = None,
    ballot: Callable[[], list[float]] | None = None,
) -> tuple[float, bool, list[float]]:
    """One optimizer step over ``accum`` micro-batches; returns the loss averaged over all ranks
    (exact float), whether any rank asked to ``stop`` and the sums of every rank's ``ballot()``
    (all three in the loss's all-reduce: no extra collective per step). ``wait_for_staging``:
    called before the update, which must not change the state a save is still copying (it
    copies beside this forward and backward).
    """
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    loss = torch.zeros((), device=device)
    for micro in range(accum):
        inputs, targets = state.loader.next_batch()
        if accum > 1:  # gradients are reduced across ranks once, with the last micro-batch
            state.model.set_requires_gradient_sync(micro == accum - 1)
        micro_loss = state.spec.loss(inputs.to(device), targets.to(device))
        if accum > 1:
            micro_loss = micro_loss / accum
        micro_loss.backward()
        loss = micro_loss.detach() if accum == 1 else loss + micro_loss.detach()
    torch.nn.utils.clip_grad_norm_(state.model.parameters(), grad_clip)
    if wait_for_staging is not None:
        wait_for_staging()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    votes = ballot() if ballot is not None else []
    total = torch.cat([loss.detach().float().reshape(1), torch.tensor([float(stop), *votes], device=loss.device)])
    dist.all_reduce(total)
    loss_sum, stops, *sums = total.tolist()
    return loss_sum / dist.get_world_size(), stops > 0, sums


class ProgressLines:
    """Rank 0's progress on stdout, where ``kubectl logs`` of worker 0 and the train step's log
    show it: a line every ``every`` steps, at the last one, and one for each restart as it happens.
    """

    def __init__(self, every: int, last: int, restarts: int) -> None:
        self.every, self.last = every, last
        self.restarts = restarts  # of this session so far

    def show(self, done: Step, restart: Restart | None) -> None:
        """Print what ``done`` (and the ``restart`` it completed, if any) calls for."""
        if restart is not None:
            self.restarts += 1
            print(restart.describe(), flush=True)
        if restart is not None or done.step == self.last or (self.every and done.step % self.every == 0):
            print(done.describe(self.last, self.restarts), flush=True)


@dataclass(frozen=True)
class ProcessParts:
    """What a rank's process makes once and every attempt of the training function uses: they
    survive an in-process restart (``mirror``: rank 0's, if any; ``startup``: when this process's
    start-up stages ended, unix times).
    """

    cfg: TrainConfig
    writer: CheckpointWriter
    mirror: CheckpointMirror | None
    preemption: Preemption
    startup: dict[str, float]


def train(parts: ProcessParts, attempt: Attempt) -> None:
    """One attempt of the training function: build, train, close. An error no restart can fix,
    and a suspected bug past its retries (``trainer.rank.failures``), end the job here, before
    in-process restart could retry them; every other failure is recorded and restarted.
    """
    cfg = parts.cfg
    failures = Failures(
        Path(cfg.run_dir), int(os.environ.get("RANK", 0)), max_bug_retries=cfg.max_bug_retries, job=_job_id()
    )
    try:
        trainer = Trainer.build(parts, attempt, failures)
        trainer.train()
        trainer.close()
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if (cause := non_transient_cause(e)) is not None:
            end_job_fatally(Path(cfg.run_dir), cause)
        # Not inside NVRx's atomic section: its termination of this attempt holds that lock until
        # this rank is back in the wrapper, so waiting for it here stalls the restart until the
        # soft timeout and then fails the process. An append is whole or absent: an interruption
        # that lands in it loses one record, never the restart. Once the wrapper's abort has cut
        # this attempt's connections, a failure here is its doing: the rank that faulted records it.
        if not attempt.connections.aborted and (fatal := failures.record(e)) is not None:
            end_job_fatally(Path(cfg.run_dir), e, fatal)
        raise


def end_job_fatally(run_dir: Path, cause: BaseException, fatal: Fatal | None = None) -> None:
    """Record ``cause`` (a ``fatal`` event, ``fatal`` when given; stderr too, since a full disk
    may refuse the event) and exit at once with ``FATAL_EXIT_CODE``: the peers' collectives fail
    and the launcher stops them; its restarts of this job exit at once (:func:`main`).
    """
    fatal = fatal or Fatal(error=f"{type(cause).__name__}: {cause}", job=_job_id())
    # The event first: stderr may be a log on the same full volume, where the print fails too.
    with contextlib.suppress(OSError):
        EventLog(run_dir, int(os.environ.get("RANK", 0))).emit(fatal)
    with contextlib.suppress(OSError):
        print(
            f"rank {os.environ.get('RANK')}: fatal, no restart can fix this: {fatal.error}", file=sys.stderr, flush=True
        )
        if fatal.traceback:
            print(fatal.traceback, file=sys.stderr, flush=True)
    os._exit(FATAL_EXIT_CODE)  # not an exception: in-process restart would retry it


def local_tier_refused(group: dist.ProcessGroup) -> str | None:
    """Collective on ``group``: why some rank cannot use its node's local tier root
    (:func:`private_local_tier_root`: not a private folder of this user's), or None when every
    rank can. Every rank then goes without the tier, or none does.
    """
    _, refused = private_local_tier_root()
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, refused, group=group)
    return next((r for r in every if r is not None), None)


def _job_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


class Trainer:
    """One attempt of the training function on this rank, in three calls: :meth:`build` (process
    groups, model, optimizer, data, tiers, resume), :meth:`train` (the loop) and :meth:`close`
    (the end of the session, or of this node's part in it). What it builds lives as long as the
    attempt: an in-process restart builds it again, around the same :class:`ProcessParts`.
    """

    def __init__(self, parts: ProcessParts, attempt: Attempt, failures: Failures) -> None:
        self.parts, self.cfg, self.attempt, self.failures = parts, parts.cfg, attempt, failures
        self.run_dir = Path(parts.cfg.run_dir)
        self.marks = dict(parts.startup)  # a recovery's timeline (the restart event's phases): when each stage ended
        self.launched = self.marks.pop("launcher_started")  # what a start's timeline (run_start's phases) counts from

    @classmethod
    def build(cls, parts: ProcessParts, attempt: Attempt, failures: Failures) -> Trainer:
        """Everything this attempt trains with, resumed from the newest complete state."""
        self = cls(parts, attempt, failures)
        self._join()
        self._build_state()
        self._build_checkpointing()
        self._resume()
        return self

    def _join(self) -> None:
        """The device, this attempt's store and the process groups; what rank 0 reads of the run."""
        cfg, attempt, marks = self.cfg, self.attempt, self.marks
        if attempt.store_port is not None:  # the wrapper's monitor process, store and barrier: every rank is in
            marks["wrapper_ready"] = time.time()
        self.rt = rt = detect_runtime()
        marks["runtime"] = time.time()  # the device and deterministic kernels (a new process imports torch._dynamo)
        self.timeouts = timeouts = Timeouts(cfg.hang_timeout, cfg.inprocess_restart)
        store = make_store(attempt, timeouts.barrier)
        if store is not None:  # every rank has joined this attempt's store
            marks["store"] = time.time()
        with attempt.connections.recording():  # an in-process restart's abort cuts them
            init_process_group(rt, store, timeouts.collective)
            marks["default_group"] = time.time()
            # Checkpoint collectives get their own gloo groups: they must never interleave with FSDP's.
            # Resume waits while rank 0 verifies checksums: a long timeout. An async save's collectives in
            # the loop are quick polls: they time out like training's, so a peer that faulted never holds
            # this rank past in-process restart's soft timeout. A sync save waits there for the slowest write.
            self.ckpt_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeouts.barrier))
            self.save_timeout = timeouts.collective if self.parts.writer.mode == "async" else timeouts.barrier
            self.save_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.save_timeout))
        marks["process_group"] = time.time()
        self.events = EventLog(self.run_dir, rt.rank)
        self.history = read_history(self.run_dir) if rt.rank == 0 else RunHistory()
        self.layer = recovery_layer(
            self.history, in_process_attempt=attempt.in_process_attempt, in_job_restart=attempt.in_job_restart
        )
        self.monitor = RankMonitor(ceiling=timeouts.heartbeat, atomic=attempt.atomic, wrapped=cfg.inprocess_restart)
        marks["rank_monitor"] = time.time()

    def _build_state(self) -> None:
        """The sharded model, its optimizer, the data, the local tier and the faults to fire."""
        cfg, rt, run_dir = self.cfg, self.rt, self.run_dir
        self.spec = build_fsdp_model(
            cfg.model,
            rt,
            cfg.seed,
            activation_checkpointing=cfg.activation_checkpointing,
            cache=run_dir / "model_cache",
        )
        model, self.seq_len = self.spec.module, cfg.seq_len or self.spec.seq_len
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        loader = TokenLoader(
            load_split(local_data(cfg.data, run_dir), "train"), self.seq_len, cfg.batch_size, rt.rank, rt.world_size
        )
        self.state = TrainState(self.spec, optimizer, loader, self.monitor, self.ckpt_group)
        self.local = self._local_tier() if cfg.local_ckpt_every else None
        self.faults = FaultInjector(
            cfg.faults,
            run_dir,
            rt.rank,
            self.events,
            local_newest=self.local.newest_own if self.local else None,
            poison=partial(poison_parameters, model),
            unwatch=self.monitor.unwatch,
        )
        self.marks["model_built"] = time.time()

    def _local_tier(self) -> LocalTier | None:
        """The local tier, unless some rank cannot use its node's root (then no rank does)."""
        cfg, rt = self.cfg, self.rt
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size))
        nnodes = rt.world_size // per_node
        cliques = replica_cliques(nnodes, per_node, cfg.replicas(nnodes))
        with self.attempt.connections.recording():
            replication = replication_groups(
                cliques, resume_timeout_s=self.timeouts.barrier, save_timeout_s=self.save_timeout
            )
        if (refused := local_tier_refused(self.ckpt_group)) is not None:
            if rt.rank == 0:
                reason = f"{refused}; training goes on with the durable tier"
                self.events.emit(RunWarning(kind="local_tier_off", step=0, reason=reason))
            return None
        return LocalTier(
            local_tier_dir(self.run_dir, cfg.trajectory_hash()),
            every=cfg.local_ckpt_every,
            group=self.ckpt_group,
            save_group=self.save_group,
            events=self.events,
            replication=replication,
        )

    def _build_checkpointing(self) -> None:
        """The heartbeats from within work, and the durable checkpointer."""
        self.heartbeat_within_work = heartbeat_within_work = throttled_heartbeat(self.heartbeat)
        heartbeat_within_steps(self.spec.fsdp_units(), heartbeat_within_work)
        mirror = self.parts.mirror
        self.checkpointer = Checkpointer(
            self.run_dir,
            writer=self.parts.writer,
            group=self.ckpt_group,
            save_group=self.save_group,
            events=self.events,
            every=self.cfg.ckpt_every,
            keep_last=self.cfg.keep_last,
            fingerprint=self.cfg.trajectory_hash(),
            heartbeat=heartbeat_within_work,
            hang_timeout=self.cfg.hang_timeout,
            on_published=mirror.submit if mirror else None,
            on_phase=self.faults.maybe_fire,
            atomic=self.attempt.atomic,
        )

    def _resume(self) -> None:
        """Restore the newest complete state (from the mirror on a fresh machine); rank 0 writes
        ``run_start`` for a fresh or deliberate start (a recovery writes ``restart`` at its first step).
        """
        cfg, rt, mirror = self.cfg, self.rt, self.parts.mirror
        if mirror is not None and not published_checkpoints(self.checkpointer.root):
            mirror.restore(fingerprint=cfg.trajectory_hash(), world_size=rt.world_size)
        self.start, self.source = resume(self.checkpointer, self.local, self.state)
        self.marks["resumed"] = time.time()
        if rt.rank == 0 and self.layer is None:  # (layer is only known on rank 0, which writes these events)
            phases = {k: t - self.launched for k, t in self.marks.items()}
            start = RunStart(
                config=cfg.to_dict(), resumed_from_step=self.start, world_size=rt.world_size, phases=phases
            )
            self.events.emit(start)

    def heartbeat(self) -> None:
        """To both hang detectors: ft_launcher's rank monitor, the in-process wrapper."""
        self.monitor.heartbeat()
        self.attempt.heartbeat()

    def wait_for_staging(self) -> None:
        """Before the update: the copies of the state that the last saves make beside this step."""
        self.checkpointer.before_update()
        if self.local is not None:
            self.local.before_update()

    def train(self) -> None:
        """The loop: a step, its record, the checkpoint tiers. A fault anywhere in it ends this
        attempt; what it was saving is never published (the writer abandons it when the next
        attempt's group arrives) and that one resumes from the newest complete state.
        """
        cfg, rt, state = self.cfg, self.rt, self.state
        self.last = last = cfg.stop_at_step or cfg.steps
        tokens_per_step = cfg.batch_size * self.seq_len * cfg.grad_accum_steps * rt.world_size
        progress = ProgressLines(cfg.log_every, last, self.history.restarts_in_session)
        self.step, self.stop = self.start, False
        for step in range(self.start + 1, last + 1):
            self.step = step
            self.failures.step = step
            with self.monitor.step(timed=step > self.start + 1):  # watched at the run's pace
                self.faults.maybe_fire(step)
                t0 = time.perf_counter()
                loss, self.stop, tally = train_step(
                    state,
                    lr_at(cfg, step),
                    cfg.grad_clip,
                    rt.device,
                    accum=cfg.grad_accum_steps,
                    stop=self.parts.preemption.requested,
                    wait_for_staging=self.wait_for_staging,
                    ballot=self.local.ballot if self.local is not None else None,
                )
                step_time = time.perf_counter() - t0
            if self.local is not None:
                self.local.tally(tally)
            # At most once a second, like those from within the step: each is a round trip to the
            # rank monitor's process, and the step watch already sees every step end.
            self.heartbeat_within_work()
            check_loss(step, loss)  # a NaN or Inf loss is a bug: this step is neither logged nor saved
            if rt.rank == 0:
                done = self.events.emit(Step(step=step, loss=loss, step_time_s=step_time, tokens=tokens_per_step))
                progress.show(done, self._restart_done(done) if step == self.start + 1 else None)
            last_save = step == last or self.stop  # waits until published
            self.checkpointer.step(step, partial(state.snapshot, step), last=last_save)
            if self.stop:
                break
            if self.local is not None and step != last:  # the last step is durable already
                self.local.step(step, partial(state.local_snapshot, step))

    def _restart_done(self, first_step: Step) -> Restart | None:
        """Rank 0, at the first step of a recovered attempt: its ``restart`` event."""
        if not self.layer:
            return None
        restart = describe_restart(
            self.history,
            layer=self.layer,
            resumed_from=self.start,
            first_step=first_step,
            marks=self.marks,
            source=self.source,
        )
        return self.events.emit(restart)

    def close(self) -> None:
        """The end: the local tier's last write, the session's end (or this node's leaving)."""
        if self.monitor.watched:
            print(
                f"rank {self.rt.rank}: {self.monitor.watched} steps watched at the run's pace, "
                f"the last within {self.monitor.watch_s:.2f} s",
                file=sys.stderr,
                flush=True,
            )
        self.monitor.stop()
        status = "preempted" if self.stop else "completed" if self.last == self.cfg.steps else "stopped"
        if self.local is not None:
            self.local.finish()  # the write in flight: done and agreed on
            if status == "completed":  # a run stopped or preempted may be resumed
                self.local.remove()
        leaving = self.parts.preemption.settle(self.ckpt_group, self.step) if self.stop else None
        if self.rt.rank == 0 and leaving is not None:  # the session goes on once the replacements join
            self.events.emit(leaving)
        elif self.rt.rank == 0:
            self.events.emit(RunEnd(status=status, step=self.step, saved_step=self.checkpointer.saved_step))
        dist.destroy_process_group()


def write_lines_whole(stream: object) -> None:
    """Make ``stream`` write a print of one line in one piece (and any text that ends its last
    line). The node's ranks write to one log, and stderr writes through: a print's text and its
    newline were two writes, and another rank's line could land between them (a test that read
    the log line by line then missed one).
    """
    with contextlib.suppress(AttributeError, ValueError):
        stream.reconfigure(line_buffering=True, write_through=False)


def main(
    argv: list[str] | None = None, *, startup: dict[str, float] | None = None, launcher_started: float | None = None
) -> None:
    """Parse the config and train, inside the in-process restart wrapper when enabled.

    Args:
        argv: the train flags (default: the command line).
        startup: when this process's start-up stages ended, unix times (default: a fresh
            interpreter's ``process_started`` and ``imports_done``; a rank forked by the node's
            zygote has its own).
        launcher_started: when the launcher that started this rank started (default: the parent process's start).
    """
    write_lines_whole(sys.stderr)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(parser)
    cfg = TrainConfig.from_mapping(vars(parser.parse_args(argv)))
    # ft_launcher restarts failed ranks whatever the cause: after a fatal error met since this
    # launcher started, its restarts end at once. (The job id alone is not enough: on Kubernetes it
    # is "none" unless elasticPolicy.rdzvId is set. A new job, once the cause is fixed, starts normally.)
    launcher_started = launcher_started or process_start_time(os.getppid())
    startup = {"launcher_started": launcher_started} | (
        startup or {"process_started": process_start_time(), "imports_done": IMPORTED_AT}
    )
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    # A PyTorchJob applied with kubectl has no launcher of ours in front of it to make the run dir
    # and check, then record, the run's identity: rank 0 does it (again, for one that had).
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    if os.environ.get("RANK", "0") == "0":
        try:
            check_run_dir(cfg)
        except ParameterError as e:
            end_job_fatally(Path(cfg.run_dir), e)
    if restarted and (fatal := fatal_error(read_events(Path(cfg.run_dir), [Fatal]), _job_id(), since=launcher_started)):
        print(
            f"rank {os.environ.get('RANK')}: not restarting, the job met an error no restart can fix: {fatal.error}",
            file=sys.stderr,
        )
        sys.exit(FATAL_EXIT_CODE)
    cuda = torch.cuda.is_available()
    die_with_parent()  # a launcher that is gone preempts this rank: nothing outlives it
    # One writer per process: its background worker survives in-process restarts. Created here,
    # before any training state: on CPU its worker is forked now; on CUDA it is spawned after the
    # first step (:meth:`Checkpointer.prepare`).
    writer = AsyncCheckpointWriter(cuda=cuda) if cfg.ckpt_mode == "async" else SyncDcpWriter()
    primary = cfg.checkpoint_uri and os.environ.get("RANK") == "0"
    mirror = CheckpointMirror(cfg.checkpoint_uri, Path(cfg.run_dir), keep_last=cfg.keep_last) if primary else None
    preemption = Preemption()
    preemption.install()
    start_system_sampler(Path(cfg.run_dir), cfg.system_metrics_every)  # per process: it outlives in-process restarts
    startup["set_up"] = time.time()  # this process's own set-up (the checks above, the writer, the handlers)
    parts = ProcessParts(cfg, writer, mirror, preemption, startup)
    try:
        if cfg.inprocess_restart:
            timeouts = Timeouts(cfg.hang_timeout, True)
            run_restartable(
                partial(train, parts),
                timeouts,
                cuda=cuda,
                max_restarts=cfg.max_inprocess_restarts,
                on_abort=RankMonitor.relax,
            )
        else:
            train(parts, Attempt())
    except BaseException:
        # A failing rank leaves at once: the launcher restarts the job as soon as it is gone. Its
        # background writer dies with it (PDEATHSIG) and what it was writing is never published;
        # a polite shutdown (the writer's last write, the interpreter's teardown) took seconds.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    writer.close()
    if mirror is not None and not mirror.close():  # training is done; say what the mirror lost, if there is room to
        last = max((s for s, _ in published_checkpoints(Path(cfg.run_dir) / CHECKPOINTS)), default=0)
        reason = f"{cfg.checkpoint_uri} may lack the run's last files (see stderr)"
        with contextlib.suppress(OSError):  # a full volume must not fail a finished run
            EventLog(Path(cfg.run_dir), 0).emit(RunWarning(kind="mirror_incomplete", step=last, reason=reason))
    if preemption.end_launcher:  # it leaves the rendezvous, so the preempted store host can go
        os.kill(launcher_pid(), signal.SIGTERM)
    # torch._dynamo formats a table of compile times at exit, for a log line nobody reads here
    # (it imports tabulate to do it: about a second); this loop compiles nothing.
    if (dynamo := sys.modules.get("torch._dynamo.utils")) is not None:
        atexit.unregister(dynamo.dump_compile_times)
    leave(preemption.exit_code)


if __name__ == "__main__":  # required: NVRx's checkpoint worker is started with spawn
    main()
