"""The training configuration: one dataclass, one argparse definition, checked up front."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainer.errors import ParameterError
from trainer.faults import FAULT_KINDS, Fault, parse_fault_spec
from trainer.models import MODEL_SIZES, check_model_name

CKPT_MODES = ("async", "sync")


LOCAL_TIER_MODELS = ("tiny", "small")
"""Models whose local tier is on by default, a snapshot every step: their two snapshots per rank
take at most about 100 MiB of a node's memory, and a snapshot's copy stalls the step far less than
a recovery to the durable checkpoint costs (docs/checkpoints.md). A larger model's snapshots
(12 bytes a parameter, twice, per node) are for the operator to budget: ``--local-ckpt-every``."""

# Fields that define the training trajectory: resuming a run dir requires them to match.
TRAJECTORY_FIELDS = (
    "model",
    "seed",
    "steps",
    "batch_size",
    "seq_len",
    "grad_accum_steps",
    "lr",
    "warmup_steps",
    "min_lr_ratio",
    "weight_decay",
    "grad_clip",
    "world_size",
)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything one training run needs; the same object on every rank."""

    data: str
    """Prepared data directory (see ``rfsdp prepare-data``)."""
    run_dir: str
    """Run directory: events, checkpoints, fault markers."""
    model: str = "tiny"
    """The model: a built-in size (tiny, small, base, large, 1b), ``hf:PATH`` (a Hugging Face
    causal LM: a directory, s3:// prefix or hub id with config.json and optionally safetensors
    weights to continue from) or ``py:package.module:factory`` (your own module; docs/models.md)."""
    steps: int = 60
    """Total optimizer steps of the run (sets the LR schedule)."""
    stop_at_step: int = 0
    """Stop cleanly after this step (0: run to ``steps``); the run stays resumable."""
    ckpt_every: int = 10
    """Checkpoint interval in steps (the last step is always checkpointed)."""
    ckpt_mode: str = "async"
    """``async`` (NVRx background writer) or ``sync`` (blocking DCP save, the baseline)."""
    keep_last: int = 3
    """Published checkpoints kept by retention."""
    local_ckpt_every: int = -1
    """Local snapshot interval in steps: each rank's state also goes to this node's memory
    (/dev/shm), at most two snapshots per rank, and recovery resumes from the newest one every
    rank can load when it is newer than the durable checkpoint (0: off; -1: the default rule,
    every step for the models up to ``small``, off for larger ones)."""
    local_replicas: int = -1
    """Peer copies of each rank's local snapshots, held by the same local rank on other nodes, so
    a replaced node's state comes back from a peer (-1: 1 when nnodes > 1 and the local tier is
    on, else 0; needs fewer replicas than nodes)."""
    seed: int = 0
    """Seed for initialization (and anything random)."""
    batch_size: int = 8
    """Sequences per rank per micro-batch."""
    seq_len: int = 0
    """Tokens per sequence (0: the model's default: a built-in size's own, an HF model's
    max_position_embeddings up to 1024)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step (gradients accumulated, synced once)."""
    activation_checkpointing: bool = False
    """Recompute each FSDP unit's activations in backward instead of keeping them (less memory,
    about a third more compute)."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    warmup_steps: int = 10
    """Linear warmup steps before the cosine decay."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    world_size: int = 2
    """Total number of ranks (nnodes x nproc_per_node)."""
    fault: str = ""
    """Fault schedule ``KIND@STEP[/PHASE][:RANK],...`` (see ``trainer.faults``)."""
    inprocess_restart: bool = True
    """Recover soft faults inside the running processes (NVRx ``inprocess.Wrapper``)."""
    max_inprocess_restarts: int = 5
    """In-process restarts the same worker processes may do; one more fault ends them and in-job
    restart takes over (a fault that recurs must not restart forever)."""
    max_bug_retries: int = 1
    """Retries of a suspected bug: the same exception, from the same line of project or user code,
    at the same step (or a loss that turns NaN or Inf). One more occurrence ends the job with a
    ``fatal`` event (reason ``bug``) that no restart retries; infrastructure faults keep the
    restart budgets (docs/recovery.md)."""
    hang_timeout: float = 10.0
    """Seconds without a heartbeat before a rank is declared hung (other timeouts derive)."""
    checkpoint_uri: str = ""
    """Optional remote location that durable checkpoints are mirrored to."""
    grace_period: float = 30.0
    """Seconds a preempted job (SIGTERM) has to finish its step, checkpoint and exit before it is
    killed (the PyTorchJob's ``terminationGracePeriodSeconds``)."""
    log_every: int = 10
    """Rank 0 prints a progress line (step, loss, tokens/s, restarts) every this many steps and at
    every restart, for ``kubectl logs`` and the train step's log (0: only at restarts and the end)."""
    system_metrics_every: float = 0.0
    """Seconds between samples of each node's CPU, memory, /dev/shm, network and GPU use, written as
    ``system`` events and logged to MLflow as system/node_<N>/... (0: off)."""
    faults: list = field(default_factory=list, repr=False)
    """Parsed ``fault`` (derived)."""

    def __post_init__(self) -> None:
        check_model_name(self.model)
        if self.log_every < 0:
            raise ParameterError("log_every", f"must be at least 0, got {self.log_every}")
        if self.local_ckpt_every < -1:
            raise ParameterError(
                "local_ckpt_every", f"must be at least 1 (or 0: off, -1: the default rule), got {self.local_ckpt_every}"
            )
        if self.local_ckpt_every == -1:
            self.local_ckpt_every = 1 if self.model in LOCAL_TIER_MODELS else 0
        if self.local_replicas < -1:
            raise ParameterError(
                "local_replicas", f"must be at least 0 (or -1: the default rule), got {self.local_replicas}"
            )
        if self.local_replicas > 0 and not self.local_ckpt_every:
            raise ParameterError(
                "local_replicas",
                f"{self.local_replicas} replica(s) of local snapshots need --local-ckpt-every (0: off)",
            )
        if self.max_inprocess_restarts < 0:
            raise ParameterError("max_inprocess_restarts", f"must be at least 0, got {self.max_inprocess_restarts}")
        if self.max_bug_retries < 0:
            raise ParameterError("max_bug_retries", f"must be at least 0, got {self.max_bug_retries}")
        if self.seq_len < 0:
            raise ParameterError("seq_len", f"must be at least 0 (0: the model's default), got {self.seq_len}")
        if self.seq_len == 0 and self.model in MODEL_SIZES:  # (an HF or py: model's is known once it is read)
            self.seq_len = MODEL_SIZES[self.model].seq_len
        for name in ("steps", "ckpt_every", "keep_last", "batch_size", "grad_accum_steps", "world_size"):
            if getattr(self, name) <= 0:
                raise ParameterError(name, f"must be positive, got {getattr(self, name)}")
        if not 0 <= self.stop_at_step <= self.steps:
            raise ParameterError("stop_at_step", f"must be in 0..{self.steps}, got {self.stop_at_step}")
        if self.ckpt_mode not in CKPT_MODES:
            raise ParameterError("ckpt_mode", f"must be one of {', '.join(CKPT_MODES)}, got {self.ckpt_mode!r}")
        for name, ok in (
            ("lr", self.lr > 0),
            ("warmup_steps", self.warmup_steps >= 0),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1),
            ("grad_clip", self.grad_clip > 0),
        ):
            if not ok:
                raise ParameterError(name, f"out of range: {getattr(self, name)}")
        if self.grace_period < 5:
            raise ParameterError("grace_period", f"must be at least 5 s, got {self.grace_period}")
        if self.system_metrics_every and self.system_metrics_every < 1:
            raise ParameterError(
                "system_metrics_every", f"must be 0 (off) or at least 1 s, got {self.system_metrics_every}"
            )
        if self.hang_timeout < 5:
            raise ParameterError("hang_timeout", f"must be at least 5 s, got {self.hang_timeout}")
        self.faults = parse_fault_spec(self.fault, steps=self.steps, world_size=self.world_size)
        for f in self.faults:
            if (
                isinstance(f, Fault)
                and f.kind == "corrupt-local"
                and not (self.local_ckpt_every and f.step > self.local_ckpt_every)
            ):
                raise ParameterError(
                    "fault", f"{f.key} corrupts a local snapshot: it needs --local-ckpt-every below step {f.step}"
                )
            if isinstance(f, Fault) and f.phase and (self.ckpt_mode != "async" or not self.saves_at(f.step)):
                raise ParameterError(
                    "fault",
                    f"{f.key} fires inside a save, but step {f.step} has no async save (every {self.ckpt_every})",
                )

    def saves_at(self, step: int) -> bool:
        """True when the run checkpoints at ``step`` (every ``ckpt_every`` steps and its last)."""
        return step % self.ckpt_every == 0 or step == (self.stop_at_step or self.steps)

    def replicas(self, nnodes: int) -> int:
        """Peer copies of each rank's local snapshots in a job of ``nnodes`` nodes:
        ``local_replicas``, or by default 1 when there is another node and a local tier, else 0.
        """
        if self.local_replicas >= 0:
            return self.local_replicas
        return 1 if nnodes > 1 and self.local_ckpt_every else 0

    def to_dict(self) -> dict:
        """Plain fields, without derived ones."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "faults"}

    def trajectory_hash(self) -> str:
        """Identity of the training trajectory (see ``TRAJECTORY_FIELDS``)."""
        ident = {k: getattr(self, k) for k in TRAJECTORY_FIELDS}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    def to_argv(self) -> list[str]:
        """The command-line arguments that reproduce this config (for worker processes)."""
        argv = []
        for key, value in self.to_dict().items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + key.replace("_", "-"))
            else:
                argv += [flag, str(value)]
        return argv

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> TrainConfig:
        """Build from named values: parsed flags (``vars(args)``) or pipeline parameters; entries
        that are not config fields, and ``None`` (a flag not given), are ignored.
        """
        names = {f.name for f in dataclasses.fields(cls)} - {"faults"}
        return cls(**{k: v for k, v in values.items() if k in names and v is not None})


def replica_cliques(nnodes: int, nproc_per_node: int, replicas: int) -> list[list[int]]:
    """The ranks that hold each other's local snapshots (NVRx's replication cliques): consecutive
    nodes in groups of ``replicas + 1`` (the last group takes the nodes left over, so every
    ``nnodes`` above ``replicas`` works), and in each group the ranks of the same local rank: each
    rank's snapshot is then held on at least ``replicas`` other nodes. No replicas: one clique per rank.
    """
    size = replicas + 1
    if replicas == 0:
        return [[rank] for rank in range(nnodes * nproc_per_node)]
    starts = list(range(0, nnodes - size + 1, size))
    node_groups = [range(start, start + size) for start in starts[:-1]] + [range(starts[-1], nnodes)]
    return [
        [node * nproc_per_node + local for node in nodes] for nodes in node_groups for local in range(nproc_per_node)
    ]


def config_defaults() -> dict[str, Any]:
    """Every config field's default (the one definition the CLI and the pipeline signature use)."""
    return {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}


def add_train_arguments(parser: argparse.ArgumentParser, *, include_world: bool = True) -> None:
    """Register every TrainConfig field as a ``--flag``: help from the field docstrings, with the
    default and the choices; ``--fault`` lists the fault kinds.
    """
    helps = _field_docs()
    helps["fault"] += " Kinds: " + "; ".join(f"{kind}: {what}" for kind, what in FAULT_KINDS.items()) + "."
    choices = {"ckpt_mode": list(CKPT_MODES)}
    for f in dataclasses.fields(TrainConfig):
        if f.name == "faults" or (f.name == "world_size" and not include_world):
            continue
        flag = "--" + f.name.replace("_", "-")
        text = " ".join(helps.get(f.name, "").split()).replace("%", "%%")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.type == "bool":  # argparse adds "(default: ...)" to these itself
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            text += "" if required else " (default: %(default)r)"
            default = None if required else f.default
            parser.add_argument(
                flag, type=kind, required=required, default=default, choices=choices.get(f.name), help=text
            )


def _field_docs() -> dict[str, str]:
    """Field docstrings of TrainConfig, read from its source."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = nxt.value.value
    return docs


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Every resilience timeout, derived from one knob so that their order always holds.

    collective (in-process only) < in-process recovery < wrapper soft < heartbeat < wrapper hard
    < barrier, and wrapper heartbeat < barrier (NVRx's rule). A rank blocked in a gloo collective
    is released when the wrapper's abort cuts the attempt's connections (at a rank's fault, or at
    the soft timeout of a rank without progress); with in-process restart gloo's own timeout stays
    below the soft timeout as the fallback should the cut not reach it. The rank monitor counts
    in-process recovery as missing heartbeats, so the heartbeat timeout must exceed it.
    """

    hang: float
    inprocess: bool

    @property
    def collective(self) -> float:
        """Training collectives (gloo/NCCL process-group timeout)."""
        return 0.3 * self.hang if self.inprocess else 6 * self.hang

    @property
    def soft(self) -> float:
        """Wrapper soft timeout: a rank without progress is interrupted."""
        return 0.8 * self.hang

    @property
    def heartbeat(self) -> float:
        """ft_launcher's rank heartbeat timeout: no heartbeat for this long is a hang."""
        return self.hang

    @property
    def hard(self) -> float:
        """Wrapper hard timeout: an unresponsive rank is killed (in-job restart takes over)."""
        return 1.6 * self.hang

    @property
    def wrapper_heartbeat(self) -> float:
        """The in-process wrapper's heartbeat timeout between the ranks' monitor processes: how
        long a rank whose node is gone (its monitor process with it) holds the others in the
        restart's barrier before in-job restart takes over. Below the heartbeat timeout, which a
        lost node otherwise waited out, and at least 3 s: the monitor processes are small and
        heartbeat every second whatever the training does. At most NVRx's default (30 s).
        """
        return min(30.0, max(3.0, 0.3 * self.hang))

    @property
    def barrier(self) -> float:
        """Store barriers, rendezvous and checkpoint collectives (checksumming is slow)."""
        return 6 * self.hang

    @property
    def initial_heartbeat(self) -> float:
        """First heartbeat after a (re)start: covers imports, model build and resume."""
        return 12 * self.hang
