"""The training entry point, run on every rank by ft_launcher (or torchrun).

Example::

    ft_launcher --nproc-per-node 2 -m trainer.rank.train --data DATA --run-dir RUN [--fault exception@20:1]

``rfsdp train`` builds that command for you (see ``trainer.launch.local``).
"""

from __future__ import annotations

import argparse
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
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from trainer.checkpoint import (
    CHECKPOINTS,
    Checkpointer,
    CheckpointWriter,
    SyncDcpWriter,
    load_tensors,
    local_tier_dir,
    private_local_tier_root,
    published_checkpoints,
    read_rank_state,
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
from trainer.models.spec import ModelSpec
from trainer.process import die_with_parent, launcher_pid, process_start_time
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
from trainer.rank.runtime import build_fsdp_model, detect_runtime, init_process_group, rng_state, set_rng_state
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


class TrainState:
    """What a checkpoint holds: sharded model + optimizer, and each rank's loader, RNG, counters."""

    def __init__(
        self,
        spec: ModelSpec,
        optimizer: torch.optim.Optimizer,
        loader: TokenLoader,
        monitor: RankMonitor,
        group: dist.ProcessGroup,
    ) -> None:
        self.spec, self.model = spec, spec.module
        self.optimizer, self.loader, self.monitor, self.group = optimizer, loader, monitor, group
        self._live_shards: dict | None = None
        """The local tier's tensor state: :meth:`snapshot`'s tree of the live tensors, each DTensor
        as this rank's shard; mapped once, mapped again after a restore (which may make new tensors)."""

    def snapshot(self, step: int) -> tuple[dict, dict]:
        """(tensor state for DCP, this rank's small state)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}, self.snapshot_rank_state(step)

    def snapshot_rank_state(self, step: int) -> dict:
        """This rank's small state: step, loader position, RNG, rank monitor."""
        return {
            "step": step,
            "loader": self.loader.state_dict(),
            "rng": rng_state(),
            "rank_monitor": self.monitor.state_dict(),
        }

    def load(self, path: Path) -> None:
        """Restore everything from a published checkpoint directory."""
        load_tensors(self.model, self.optimizer, path, self.group)
        self._live_shards = None
        self._load_rank_state(read_rank_state(path, dist.get_rank()))  # verified against the manifest as read

    def local_snapshot(self, step: int) -> dict:
        """What :meth:`snapshot` holds, with this rank's shards as plain local tensors (the
        local tier's snapshot: it is only ever loaded back by the same rank of the same world).
        The tensors are the live ones, which the tier copies at once. Training updates them in
        place, so DCP maps the model and optimizer to them once (a fixed cost per call, most of a
        small model's snapshot); only the optimizer's hyperparameters (the learning rate changes
        every step) are read again.
        """
        if self._live_shards is None:
            tensors, rank_state = self.snapshot(step)  # (DCP makes the optimizer's state if it has none yet)
            self._live_shards = _local_shards(tensors)
        else:
            rank_state = self.snapshot_rank_state(step)
            for saved, live in zip(
                self._live_shards["optim"]["param_groups"], self.optimizer.param_groups, strict=True
            ):
                saved.update((k, v) for k, v in live.items() if k != "params")  # "params": the names DCP mapped them to
        return {"tensors": self._live_shards, "rank": rank_state}

    def restore(self, snapshot: dict) -> None:
        """Restore everything from what :meth:`local_snapshot` returned."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # the live shards, to copy into
        template = _copy_shards_into({"model": model_sd, "optim": optim_sd}, snapshot["tensors"])
        set_state_dict(
            self.model, self.optimizer, model_state_dict=template["model"], optim_state_dict=template["optim"]
        )
        self._live_shards = None  # loading may give the optimizer new tensors
        self._load_rank_state(snapshot["rank"])

    def _load_rank_state(self, rank_state: dict) -> None:
        self.loader.load_state_dict(rank_state["loader"])
        set_rng_state(rank_state["rng"])
        self.monitor.load_state_dict(rank_state["rank_monitor"])


def _local_shards(tree: object) -> object:
    """``tree`` with every DTensor replaced by this rank's shard of it."""
    if isinstance(tree, dict):
        return {k: _local_shards(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_local_shards(v) for v in tree]
    return tree.to_local() if isinstance(tree, DTensor) else tree


def _copy_shards_into(template: object, saved: object) -> object:
    """``template`` (a state dict of live shards) with the values of ``saved`` (its
    :func:`_local_shards` form) copied in, tensors in place; returns it.
    """
    if isinstance(template, dict):
        return {k: _copy_shards_into(v, saved[k]) for k, v in template.items()}
    if isinstance(template, list):
        return [_copy_shards_into(v, s) for v, s in zip(template, saved, strict=True)]
    if isinstance(template, torch.Tensor):
        (template.to_local() if isinstance(template, DTensor) else template).copy_(saved)
        return template
    return saved


def resume(checkpointer: Checkpointer, local: LocalTier | None, state: TrainState) -> tuple[int, str]:
    """Restore the newest complete state every rank can load: the local tier's (each rank's own
    snapshot, else a peer's replica of it) when it is newer than the durable checkpoint, else the
    durable one. Returns its step (0: none) and source (``local``, ``peer`` or ``durable``).
    """
    durable = checkpointer.find_latest()
    newest_local, source = local.find_latest() if local is not None else (0, "local")
    if newest_local > durable:
        state.restore(local.load(newest_local))
        return newest_local, source
    if durable:  # an older one when a shard of that one is found stale as it loads
        durable = checkpointer.load(durable, state.load)
    return durable, "durable"


def train_step(
    state: TrainState, lr: float, grad_clip: float, device: torch.device, *, accum: int = 1, stop: bool = False
) -> tuple[float, bool]:
    """One optimizer step over ``accum`` micro-batches; returns the loss averaged over all ranks
    (exact float) and whether any rank asked to ``stop`` (agreed in the loss's all-reduce: no
    extra collective per step).
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
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    total = torch.stack([loss.detach().float(), torch.tensor(float(stop), device=loss.device)])
    dist.all_reduce(total)
    loss_sum, stops = total.tolist()
    return loss_sum / dist.get_world_size(), stops > 0


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


def train(
    cfg: TrainConfig,
    writer: CheckpointWriter,
    mirror: CheckpointMirror | None,
    preemption: Preemption,
    startup: dict[str, float],
    attempt: Attempt,
) -> None:
    """One attempt of the training function (``mirror``: rank 0's, if any; ``startup``: when
    this process's start-up stages ended, unix times). An error no restart can fix, and a
    suspected bug past its retries (``trainer.rank.failures``), end the job here, before
    in-process restart could retry them; every other failure is recorded and restarted.
    """
    failures = Failures(
        Path(cfg.run_dir), int(os.environ.get("RANK", 0)), max_bug_retries=cfg.max_bug_retries, job=_job_id()
    )
    try:
        _train(cfg, writer, mirror, preemption, startup, attempt, failures)
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


def _train(
    cfg: TrainConfig,
    writer: CheckpointWriter,
    mirror: CheckpointMirror | None,
    preemption: Preemption,
    startup: dict[str, float],
    attempt: Attempt,
    failures: Failures,
) -> None:
    marks = dict(startup)  # a recovery's timeline (the restart event's phases): when each stage ended
    launched = marks.pop("launcher_started")  # what a start's timeline (run_start's phases) counts from
    if (
        attempt.store_port is not None
    ):  # the wrapper's monitor process, store and barrier: every rank is in this attempt
        marks["wrapper_ready"] = time.time()
    rt = detect_runtime()
    marks["runtime"] = (
        time.time()
    )  # the device and deterministic kernels (a new process imports torch._dynamo here: seconds)
    timeouts = Timeouts(cfg.hang_timeout, cfg.inprocess_restart)
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
        ckpt_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeouts.barrier))
        save_timeout = timeouts.collective if writer.mode == "async" else timeouts.barrier
        save_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=save_timeout))
    marks["process_group"] = time.time()
    run_dir = Path(cfg.run_dir)
    events = EventLog(run_dir, rt.rank)
    history = read_history(run_dir) if rt.rank == 0 else RunHistory()
    layer = recovery_layer(
        history, in_process_attempt=attempt.in_process_attempt, in_job_restart=attempt.in_job_restart
    )

    monitor = RankMonitor()
    marks["rank_monitor"] = time.time()
    spec = build_fsdp_model(
        cfg.model, rt, cfg.seed, activation_checkpointing=cfg.activation_checkpointing, cache=run_dir / "model_cache"
    )
    model, seq_len = spec.module, cfg.seq_len or spec.seq_len
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    loader = TokenLoader(
        load_split(local_data(cfg.data, run_dir), "train"), seq_len, cfg.batch_size, rt.rank, rt.world_size
    )
    state = TrainState(spec, optimizer, loader, monitor, ckpt_group)
    local = None
    if cfg.local_ckpt_every:
        tier_dir = local_tier_dir(run_dir, cfg.trajectory_hash())
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size))
        nnodes = rt.world_size // per_node
        cliques = replica_cliques(nnodes, per_node, cfg.replicas(nnodes))
        with attempt.connections.recording():
            replication = replication_groups(cliques, resume_timeout_s=timeouts.barrier, save_timeout_s=save_timeout)
        if (refused := local_tier_refused(ckpt_group)) is None:
            local = LocalTier(
                tier_dir,
                every=cfg.local_ckpt_every,
                group=ckpt_group,
                save_group=save_group,
                events=events,
                replication=replication,
            )
        elif rt.rank == 0:
            events.emit(
                RunWarning(kind="local_tier_off", step=0, reason=f"{refused}; training goes on with the durable tier")
            )
    faults = FaultInjector(
        cfg.faults,
        run_dir,
        rt.rank,
        events,
        local_newest=local.newest_own if local else None,
        poison=partial(poison_parameters, model),
    )
    marks["model_built"] = time.time()

    def heartbeat() -> None:  # to both hang detectors: ft_launcher's rank monitor, the in-process wrapper
        monitor.heartbeat()
        attempt.heartbeat()

    heartbeat_within_work = throttled_heartbeat(heartbeat)
    heartbeat_within_steps(spec.fsdp_units(), heartbeat_within_work)

    checkpointer = Checkpointer(
        run_dir,
        writer=writer,
        group=ckpt_group,
        save_group=save_group,
        events=events,
        every=cfg.ckpt_every,
        keep_last=cfg.keep_last,
        fingerprint=cfg.trajectory_hash(),
        heartbeat=heartbeat_within_work,
        hang_timeout=cfg.hang_timeout,
        on_published=mirror.submit if mirror else None,
        on_phase=faults.maybe_fire,
        atomic=attempt.atomic,
    )

    def before_update(*_: object) -> None:  # (a step pre-hook returns None)
        checkpointer.before_update()

    # An async save copies the state while the next step's forward and backward run: its update waits for the copy.
    optimizer.register_step_pre_hook(before_update)
    if mirror is not None and not published_checkpoints(checkpointer.root):  # a fresh machine: resume from the mirror
        mirror.restore(fingerprint=cfg.trajectory_hash(), world_size=rt.world_size)
    start, source = resume(checkpointer, local, state)
    marks["resumed"] = time.time()
    if rt.rank == 0 and layer is None:  # (layer is only known on rank 0, which writes these events)
        phases = {k: t - launched for k, t in marks.items()}
        events.emit(RunStart(config=cfg.to_dict(), resumed_from_step=start, world_size=rt.world_size, phases=phases))

    last = cfg.stop_at_step or cfg.steps
    tokens_per_step = cfg.batch_size * seq_len * cfg.grad_accum_steps * rt.world_size
    progress = ProgressLines(cfg.log_every, last, history.restarts_in_session)
    # A fault anywhere below ends this attempt; what it was saving is never published (the
    # writer abandons it when the next attempt's group arrives) and that one resumes from the
    # newest complete state (:func:`resume`).
    step, stop = start, False
    for step in range(start + 1, last + 1):
        failures.step = step
        faults.maybe_fire(step)
        t0 = time.perf_counter()
        loss, stop = train_step(
            state, lr_at(cfg, step), cfg.grad_clip, rt.device, accum=cfg.grad_accum_steps, stop=preemption.requested
        )
        step_time = time.perf_counter() - t0
        heartbeat()
        check_loss(step, loss)  # a NaN or Inf loss is a bug: this step is neither logged nor saved
        if rt.rank == 0:
            done = events.emit(Step(step=step, loss=loss, step_time_s=step_time, tokens=tokens_per_step))
            restart = (
                events.emit(
                    describe_restart(
                        history, layer=layer, resumed_from=start, first_step=done, marks=marks, source=source
                    )
                )
                if layer and step == start + 1
                else None
            )
            progress.show(done, restart)
        checkpointer.step(step, partial(state.snapshot, step), last=step == last or stop)  # last: waits until published
        if stop:
            break
        if local is not None and step != last:  # the last step is durable already
            local.step(step, partial(state.local_snapshot, step))
    monitor.stop()
    status = "preempted" if stop else "completed" if last == cfg.steps else "stopped"
    if local is not None:
        local.finish()  # the write in flight: done and agreed on
        if status == "completed":  # a run stopped or preempted may be resumed
            local.remove()
    leaving = preemption.settle(ckpt_group, step) if stop else None
    if rt.rank == 0 and leaving is not None:  # the session goes on once the replacements join
        events.emit(leaving)
    elif rt.rank == 0:
        events.emit(RunEnd(status=status, step=step, saved_step=checkpointer.saved_step))
    dist.destroy_process_group()


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
    try:
        if cfg.inprocess_restart:
            timeouts = Timeouts(cfg.hang_timeout, True)
            restartable = partial(train, cfg, writer, mirror, preemption, startup)
            run_restartable(restartable, timeouts, cuda=cuda, max_restarts=cfg.max_inprocess_restarts)
        else:
            train(cfg, writer, mirror, preemption, startup, Attempt())
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
    sys.exit(preemption.exit_code)


if __name__ == "__main__":  # required: NVRx's checkpoint worker is started with spawn
    main()
