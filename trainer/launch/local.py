"""The launch contract: one worker command (ft_launcher + trainer args) for every backend.

On a cluster the training operator starts that command in each PyTorchJob pod and injects the
``PET_*`` rendezvous environment. ``launch_local`` runs the same command as local processes, one
ft_launcher per replica, with exactly the environment the operator would inject, so a local run
exercises the cluster's launch contract (multi-node rendezvous included). A :class:`Placement`
says where each replica runs: all on this host (:class:`SameHost`), or each on its own network
namespace host (``trainer.emulation.netns.LocalCluster``), where replicas are supervised like pods and
node faults are fired.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Protocol

from trainer import cgroup
from trainer.checkpoint import local_tier_dir, local_tier_root
from trainer.data.prepare import local_data
from trainer.data.shards import DataError, data_vocab, load_manifest, verify_shards
from trainer.errors import FATAL_EXIT_CODE, ParameterError, as_pipeline_parameters
from trainer.events import EventLog, RunEnd, Step, fatal_error, read_events
from trainer.faults import NodeControl, NodeFault, NodeFaultInjector, parse_fault_spec
from trainer.launch.progress import TrainingProgress
from trainer.launch.spec import LaunchSpec
from trainer.models import ModelInfo, check_model, parameter_count
from trainer.process import die_with_parent, process_start_ticks
from trainer.rank.config import Timeouts, TrainConfig, replica_cliques
from trainer.rank.identity import check_run_dir
from trainer.rank.pace import STEP_SECTION
from trainer.storage.store import StorageError

DEFAULT_RDZV_PORT = 29400
BACKENDS = ("local", "kubernetes")
"""Where the train step runs the worker command: local processes or a PyTorchJob."""


def worker_command(cfg: TrainConfig, python: str = "python") -> list[str]:
    """The command every replica runs: ft_launcher (rendezvous from ``PET_*``), run by
    ``trainer.launch.agent`` with the node's pre-warmed zygote started beside it, + the trainer,
    each rank forked by that zygote (``trainer.launch.worker``).
    """
    t = Timeouts(cfg.hang_timeout, cfg.inprocess_restart)
    return [
        python,
        "-m",
        "trainer.launch.agent",
        "--ft-restart-policy",
        "any-failed",
        "--ft-initial-rank-heartbeat-timeout",
        f"{t.initial_heartbeat:g}",
        "--ft-rank-heartbeat-timeout",
        f"{t.heartbeat:g}",
        "--ft-rank-section-timeouts",
        f"{STEP_SECTION}:none",  # each rank watches its steps at the run's pace (trainer.rank.pace)
        "--ft-workload-check-interval",
        "0.1",  # a watch that ran out is acted on within 0.1 s (NVRx's default: 5 s)
        "--ft-enable-nic-monitor",
        "false",
        "--monitor-interval",
        "0.1",  # a rank's exit is seen within 0.1 s (torchrun's default; a check is cheap)
        "--term-timeout",
        f"{cfg.grace_period:g}",  # a SIGTERM it forwards to the ranks: their time to checkpoint
        "--workers-stop-timeout",
        "0",  # ranks it stops to restart them have nothing to save: SIGKILL at once
        "-m",
        "trainer.launch.worker",
        *cfg.to_argv(),  # each rank forked by the node's zygote (trainer.launch.zygote)
    ]


def job_id(pid: int | None = None) -> str:
    """The id of the job launched by process ``pid`` (default: this one), its rendezvous id: the
    pid and its start in clock ticks, so that a later job whose launcher got the same pid is
    another job, and an earlier job's ``fatal`` never ends it.
    """
    return f"rfsdp-{pid or os.getpid()}-{process_start_ticks(pid)}"


def operator_env(spec: LaunchSpec, *, rdzv_endpoint: str, job_id: str) -> dict[str, str]:
    """The rendezvous environment the training operator injects into every Worker pod of a
    PyTorchJob with an ``elasticPolicy`` (docs/cluster.md, "Run on a Kubeflow cluster").
    """
    return {
        "PYTHONUNBUFFERED": "1",
        "PET_NNODES": f"{spec.nnodes}:{spec.nnodes}",
        "PET_NPROC_PER_NODE": str(spec.nproc_per_node),
        "PET_RDZV_ENDPOINT": rdzv_endpoint,
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ID": job_id,
        "PET_MAX_RESTARTS": str(spec.max_restarts),
    }


def job_from_parameters(params: Mapping[str, Any], *, data: str, run_dir: str) -> tuple[TrainConfig, LaunchSpec]:
    """The training config and launch spec from flat parameters named like the train flags in
    snake_case (the pipeline's parameters); extra entries are ignored.

    Raises:
        ParameterError: a bad value, naming the parameter as it was given (``ckpt_every``, not ``--ckpt-every``).
    """
    with as_pipeline_parameters():
        spec = LaunchSpec(
            nnodes=params["nnodes"], nproc_per_node=params["nproc_per_node"], max_restarts=params["max_restarts"]
        )
        cfg = TrainConfig.from_mapping({**params, "data": data, "run_dir": run_dir, "world_size": spec.world_size})
        check_local_replicas(cfg, spec)
        return cfg, spec


def gpu_count() -> int:
    """The GPUs this machine's processes see. Without an NVIDIA device node there are none, and
    the launcher skips importing torch (seconds of CPU for every job started, its ranks pay their own).
    """
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        return 0
    import torch

    return torch.cuda.device_count()


def check_launch(cfg: TrainConfig, spec: LaunchSpec, *, verify_data: bool = True) -> None:
    """Everything that can be refused before a process starts; raises ValueError naming it."""
    if cfg.world_size != spec.world_size:
        raise ParameterError(
            "world_size", f"{cfg.world_size} does not match nnodes x nproc_per_node = {spec.world_size}"
        )
    faults = parse_fault_spec(cfg.fault, steps=cfg.steps, world_size=cfg.world_size, nnodes=spec.nnodes)
    if any(f.kind == "oom" for f in faults) and cgroup.memory_limit(cgroup.memory_dir()) is None:
        raise ParameterError(
            "fault",
            "oom needs a memory limit: run the job in a memory-limited cgroup (as a container is); "
            "without one the rank would take the whole machine's memory",
        )
    check_local_replicas(cfg, spec)
    gpus = gpu_count()
    if gpus and spec.nproc_per_node > gpus:
        raise ParameterError("nproc_per_node", f"{spec.nproc_per_node} does not fit this machine ({gpus} GPUs)")
    cpus = os.cpu_count() or 1
    if spec.nproc_per_node > max(cpus, 2):
        raise ParameterError("nproc_per_node", f"{spec.nproc_per_node} does not fit this machine ({cpus} CPUs)")
    try:
        data = local_data(
            cfg.data, Path(cfg.run_dir)
        )  # an s3:// data set is fetched (verified) into the run dir's cache
        manifest = load_manifest(data)
        if verify_data:
            verify_shards(data, manifest)
    except (DataError, StorageError) as e:
        raise ParameterError("data", str(e)) from e
    info = check_model_fits(cfg, manifest)
    check_run_dir(cfg)  # the run dir's and the mirror location's identity: checked, then recorded
    if cfg.local_ckpt_every:
        free = shutil.disk_usage(_existing_parent(local_tier_root())).free
        check_local_tier(cfg, spec, free_bytes=free, parameters=info.parameters)


def check_model_fits(cfg: TrainConfig, manifest: dict) -> ModelInfo:
    """Check the model (path, config, weights, factory) and that its vocabulary covers the data's
    token ids; settle ``cfg.seq_len`` (0: the model's default), so every rank and the run's
    record see the same number. Raises ParameterError naming ``model``.
    """
    info = check_model(cfg.model)
    vocab, largest = data_vocab(manifest)
    if info.vocab_size <= largest:
        problem = (
            f"{cfg.model} has a vocabulary of {info.vocab_size}, smaller than the data's largest token id {largest} "
            f"(--data {cfg.data}: tokenizer {manifest.get('tokenizer')}, vocabulary {vocab})"
        )
        raise ParameterError("model", problem)
    cfg.seq_len = cfg.seq_len or info.seq_len
    return info


def check_local_replicas(cfg: TrainConfig, spec: LaunchSpec) -> None:
    """Refuse peer replicas that no other node could hold (``--local-replicas``)."""
    replicas = cfg.replicas(spec.nnodes)
    if replicas and spec.nnodes == 1:
        raise ParameterError(
            "local_replicas", f"{replicas} replica(s) of local snapshots need other nodes to hold them, but nnodes is 1"
        )
    if replicas >= spec.nnodes:
        problem = (
            f"{replicas} replicas of local snapshots need {replicas + 1} nodes (one per copy), "
            f"but nnodes is {spec.nnodes}"
        )
        raise ParameterError("local_replicas", problem)


LOCAL_SNAPSHOTS = 2
"""Local snapshots a rank holds at most: the newest complete one and the one being written."""
LOCAL_MARGIN = 1.25
"""Headroom over the estimate: the loader, RNG and optimizer metadata, and the write's buffers."""


def local_tier_bytes(cfg: TrainConfig, spec: LaunchSpec, *, parameters: int | None = None) -> int:
    """Memory the local tier needs on one node: per rank, ``LOCAL_SNAPSHOTS`` snapshots of its
    shards of the parameters and AdamW's two moments (fp32), with ``LOCAL_MARGIN``, for itself
    and for every peer whose replica it holds (its replication clique's size, the largest one's).
    """
    per_rank = (parameters or parameter_count(cfg.model)) * (1 + 2) * 4 / spec.world_size
    copies = max(len(c) for c in replica_cliques(spec.nnodes, spec.nproc_per_node, cfg.replicas(spec.nnodes)))
    return int(per_rank * copies * LOCAL_SNAPSHOTS * LOCAL_MARGIN * spec.nproc_per_node)


def check_local_tier(cfg: TrainConfig, spec: LaunchSpec, *, free_bytes: int, parameters: int | None = None) -> None:
    """Refuse a local tier that ``free_bytes`` of node memory (``/dev/shm``) cannot hold."""
    need = local_tier_bytes(cfg, spec, parameters=parameters)
    if need > free_bytes:
        replicas = cfg.replicas(spec.nnodes)
        held = f" (and of the peers they hold replicas of, --local-replicas {replicas})" if replicas else ""
        raise ParameterError(
            "local_ckpt_every",
            f"{LOCAL_SNAPSHOTS} local snapshots of each of {spec.nproc_per_node} ranks on a node{held} "
            f"need {need / 2**20:,.0f} MiB of /dev/shm (model {cfg.model}, world size {spec.world_size}), "
            f"but {free_bytes / 2**20:,.0f} MiB are free (--local-ckpt-every 0: no local tier)",
        )


def _existing_parent(path: Path) -> Path:
    """``path``, or its nearest parent that exists (the tier's folder is made by the first save)."""
    while not path.exists():
        path = path.parent
    return path


RUN_DIR_LOCK = ".lock"


@contextlib.contextmanager
def hold_run_dir(run_dir: Path) -> Iterator[int]:
    """Hold ``run_dir`` for one job; yields the lock's file descriptor.

    The lock is the kernel's (``flock``): a second job on a live run dir is refused at once, naming
    the holder, before it writes anything; a holder that died released it, so a stale lock is simply
    taken over. Pass the descriptor to the replicas so that the lock lives as long as any of them.

    Raises:
        ParameterError: naming ``run_dir`` and the job that holds it.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / RUN_DIR_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that has not said who it is"
            raise ParameterError(
                "run_dir", f"{run_dir} is in use by a live job ({holder}); wait for it to end or use another run dir"
            ) from None
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {since}\n".encode(), 0)
        yield fd
    finally:
        os.close(fd)


# Below the kernel's ephemeral range (32768 and up on Linux), so that no port 0 and no outgoing
# connection (gloo opens many) takes one of ours between the check and the bind; in two parts, so
# that one job's single port never lands in another's store block, whose ports bind one by one.
STORE_PORTS = (10000, 26000)
SINGLE_PORTS = (26000, 32000)


def free_port() -> int:
    """A TCP port free on loopback right now, in :data:`SINGLE_PORTS`. From the kernel's port 0,
    two runs started at once met: one's rank bound a gloo listener on the port the other's
    launcher had found free for its rendezvous.
    """
    return free_port_base(1, low=SINGLE_PORTS[0], high=SINGLE_PORTS[1])


# The in-process restart stores listen on PORT_BASE + 100 * (MASTER_PORT % 16) + 1 + attempt
# (trainer.rank.resilience): a block of 16 x 100 ports.
STORE_PORT_SPAN = 1600


def free_port_base(span: int = STORE_PORT_SPAN, *, low: int = STORE_PORTS[0], high: int = STORE_PORTS[1]) -> int:
    """The first of ``span`` ports, all free on loopback right now, between ``low`` and ``high``
    (by default a block of :data:`STORE_PORTS`).
    """
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(low, high - span)
        if all(_port_free(port) for port in range(base, base + span)):
            return base
    raise RuntimeError(f"no block of {span} free ports between {low} and {high}")


def _port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now. With SO_REUSEADDR, as every store binds: a
    port that an earlier job's connection holds in TIME_WAIT (60 s after it closed) is free to
    them. Without it, a minute of short jobs left no block of free ports, and the next job was
    refused before it started ("no block of 1600 free ports").
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class Placement(Protocol):
    """Where each replica (one ft_launcher and its workers) runs."""

    restart_on_failure: bool
    """Restart a replica whose launcher exits non-zero (pods with restartPolicy OnFailure),
    within the job's restart budget; otherwise that exit fails the job."""

    def rdzv_endpoint(self) -> str:
        """``HOST:PORT`` of the rendezvous (on replica 0's host)."""

    def replica_command(self, node: int, argv: list[str]) -> list[str]:
        """The command that runs ``argv`` as replica ``node``."""

    def replica_env(self, node: int) -> dict[str, str]:
        """Environment specific to replica ``node`` (on top of the operator's)."""


class SameHost:
    """Every replica a process group on this machine, rendezvous on loopback."""

    restart_on_failure = False

    def __init__(self) -> None:
        self._endpoint = f"127.0.0.1:{free_port()}"

    def rdzv_endpoint(self) -> str:
        """A free loopback port."""
        return self._endpoint

    def replica_command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` itself."""
        return argv

    def replica_env(self, node: int) -> dict[str, str]:
        """Nothing beyond the operator's environment."""
        return {}


def launch_local(
    cfg: TrainConfig,
    spec: LaunchSpec,
    *,
    progress: bool = True,
    log_dir: Path | None = None,
    placement: Placement | None = None,
) -> int:
    """Run the job as local processes (one ft_launcher per replica, placed by ``placement``,
    default :class:`SameHost`) and wait for it.

    Returns the job's exit code (0: every replica succeeded). The replicas' output goes to
    ``RUN_DIR/logs/replica_<i>.log``; a failed job gets a ``run_end`` event with status failed.
    Node faults in ``cfg`` are fired here and need a placement that is a ``NodeControl``.
    """
    check_launch(cfg, spec)
    placement = placement or SameHost()
    node_faults = [f for f in cfg.faults if isinstance(f, NodeFault)]
    if node_faults and not isinstance(placement, NodeControl):
        raise ParameterError("fault", f"{node_faults[0].kind} needs every replica on its own host (--netns)")
    run_dir = Path(cfg.run_dir)
    with hold_run_dir(run_dir) as lock_fd:  # held by the replicas too: the run dir is theirs while any of them lives
        log_dir = Path(log_dir or run_dir / "logs")
        log_dir.mkdir(parents=True, exist_ok=True)
        job = job_id()
        env = {
            **os.environ,
            **operator_env(spec, rdzv_endpoint=placement.rdzv_endpoint(), job_id=job),
            "RFSDP_PORT_BASE": str(free_port_base()),
        }
        argv = worker_command(cfg, sys.executable)
        replicas = [
            _Replica(
                placement.replica_command(n, argv),
                {**env, **placement.replica_env(n)},
                log_dir / f"replica_{n}.log",
                keep_fd=lock_fd,
            )
            for n in range(spec.nnodes)
        ]
        budget = spec.max_restarts if placement.restart_on_failure else 0
        injector = NodeFaultInjector(node_faults, run_dir, placement) if node_faults else None
        try:
            for replica in replicas:
                replica.start()
            code = _wait_with_progress(cfg, replicas, budget, injector, job, show=progress)
        finally:  # a job still running here was interrupted: it is preempted
            stop_replicas(replicas, cfg.grace_period + 10)
            if (
                cfg.local_ckpt_every
            ):  # memory: nothing of the tier outlives the job (a later resume takes the durable tier)
                shutil.rmtree(local_tier_dir(run_dir, cfg.trajectory_hash()), ignore_errors=True)
        if code:
            try:
                EventLog(run_dir, rank=-1).emit(RunEnd(status="failed", exit_code=code))
            except OSError as e:  # (a full volume): the exit code still says it; the launcher does not die of it
                print(f"rfsdp train: the run's end is not recorded in the events: {e}", file=sys.stderr)
        return code


class _Replica:
    """One replica's launcher process, (re)startable like a pod's container."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, *, keep_fd: int) -> None:
        self.command, self.env, self.log_path, self.keep_fd = command, env, log_path, keep_fd
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None
        self._terminated = False

    def start(self) -> None:
        """Start (or restart) the launcher; its output is appended to the replica's log."""
        self._log = self._log or open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            self.command,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(self.keep_fd,),
            preexec_fn=die_with_parent,  # a launcher killed outright preempts its replicas instead of orphaning them
        )

    def poll(self) -> int | None:
        """The launcher's exit code, None while it runs."""
        return self.proc.poll()

    def terminate(self) -> None:
        """SIGTERM to the launcher, if it still runs, which forwards it to its ranks: they
        checkpoint and exit. To the launcher alone, as a container runtime signals PID 1: its rank
        monitors (in its process group) must keep answering the ranks' heartbeats meanwhile.
        """
        self._terminated = self.proc is not None and self.proc.poll() is None
        if self._terminated:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float) -> None:
        """After :meth:`terminate`: wait up to ``grace_s`` for the launcher it signalled to end,
        SIGKILL whatever is left of its process group, and close the log.
        """
        if self._terminated:
            self._terminated = False
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def stop_replicas(replicas: list[_Replica], grace_s: float) -> None:
    """Stop every replica's launcher within ``grace_s`` together, all signalled at once, as a
    cluster signals every pod of a job it stops. One at a time, a launcher whose ranks had
    stopped with their peers' (a preemption stops every rank) waited in torch elastic's exit
    barrier for the one not yet signalled, and was killed at the end of its grace period: a
    preempted 2-node job took 55 s to end, not 3.
    """
    deadline = time.monotonic() + grace_s
    for replica in replicas:
        replica.terminate()
    for replica in replicas:
        replica.stop(max(0.0, deadline - time.monotonic()))


def _wait_with_progress(
    cfg: TrainConfig,
    replicas: list[_Replica],
    budget: int,
    injector: NodeFaultInjector | None,
    job_id: str,
    *,
    show: bool,
) -> int:
    """Wait for the replicas and return the job's exit code. While they run: show step, loss,
    tokens/s and restarts, fire node faults as the steps go by, and restart a failed replica
    while ``budget`` lasts (a replica failing beyond it fails the job). After a ``fatal`` event
    of this job nothing is restarted: the job ends with ``FATAL_EXIT_CODE``.
    """
    with TrainingProgress(Path(cfg.run_dir), cfg.stop_at_step or cfg.steps, show=show) as progress:
        while True:
            codes = [r.poll() for r in replicas]
            for replica, code in zip(replicas, codes, strict=True):
                if code:
                    if fatal_error(read_events(Path(cfg.run_dir)), job_id):
                        return FATAL_EXIT_CODE
                    if budget <= 0:
                        return code  # a replica failed for good: the job has failed
                    budget -= 1
                    replica.start()
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)  # node faults fire at the step they name: poll often
            if injector is not None:
                injector.tick()
            for e in progress.poll():
                if isinstance(e, Step) and injector is not None:
                    injector.observe(e.step)
