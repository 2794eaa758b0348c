"""Checkpoint stall: the same sharded FSDP state (model + AdamW) saved repeatedly while training,
by four methods, in interleaved rounds on 2 real ranks (torchrun, gloo):

- ``nvrx_async``: our path, ``AsyncCheckpointWriter`` through ``Checkpointer`` (what the trainer runs)
- ``torch_save``: synchronous per-rank ``torch.save`` of the local shards (+ fsync: durable)
- ``dcp_save``: synchronous DCP save, the trainer's ``--ckpt-mode sync`` (``SyncDcpWriter``)
- ``dcp_async_save``: PyTorch's ``dcp.async_save`` on its own gloo group

Each round of a method: a few steps with nothing in flight (the reference step time), a save (the
stall: how long the training loop is stopped, slowest rank), then training steps until every rank
agrees the checkpoint is durable (time until durable, and the step time while the write runs).
Every method writes with fsync, so "durable" means the same for all of them. Round 0 is the
warm-up (reported separately). For the two methods that run the trainer's ``Checkpointer``, the
time of each phase of a save comes from the ``checkpoint`` events it writes (rank 0's, as in a
production run): the stall is ``wait`` + ``collect`` + ``rank_state`` + ``stage`` + ``plan`` +
``handoff`` + ``copy_wait`` (async: the next optimizer step's wait for the ``copy`` into the staging
buffers, which overlaps that step's forward and backward) or ``write`` (sync), then ``background``,
``agree`` and ``publish`` until durable;
the first save also shows ``prepare``, the writer's warm-up after the first training step (staging
buffers and DCP's plan, cached from then on), which is neither in its stall nor in its time to durable.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from bench.common import (
    fmt,
    fresh_dir,
    interleaved,
    median,
    print_table,
    print_targets,
    ratio,
    run_torchrun,
    target,
)
from trainer.checkpoint import Checkpointer, SyncDcpWriter
from trainer.data.loader import TokenLoader
from trainer.data.shards import load_split
from trainer.events import Checkpoint, EventLog, read_events, select
from trainer.models.builtin import BuiltinModel, ModelSize, size_parameters
from trainer.rank.resilience import AsyncCheckpointWriter, RankMonitor
from trainer.rank.runtime import build_fsdp_model, detect_runtime, init_process_group, seed_everything, shard_model
from trainer.rank.state import TrainState
from trainer.rank.train import train_step

METHODS = ("nvrx_async", "torch_save", "dcp_save", "dcp_async_save")
REFERENCE = "torch_save"
PHASED = ("nvrx_async", "dcp_save")
"""The methods that save through the trainer's ``Checkpointer``, whose events time each phase."""
# Full size: base's width with 14 blocks, 99M parameters: 1.19 GB of fp32 params + AdamW moments
# (over 1 GiB), with short sequences so a CPU step stays around a second.
FULL = {"size": ModelSize(dim=768, layers=14, heads=12, seq_len=64), "batch": 1, "rounds": 5, "base_steps": 3}
QUICK = {"size": ModelSize(dim=256, layers=4, heads=8, seq_len=64), "batch": 2, "rounds": 2, "base_steps": 2}
MAX_INFLIGHT_STEPS = 500


# ---------------------------------------------------------------- the methods (run on every rank)
class _CheckpointerMethod:
    """Our Checkpointer with a writer (NVRx async or sync DCP): exactly the trainer's save path."""

    def __init__(self, root: Path, writer: object, state: TrainState, group: dist.ProcessGroup) -> None:
        self.root = root
        self.state = state
        self.ckpt = Checkpointer(
            root,
            writer=writer,
            group=group,
            events=EventLog(root, dist.get_rank()),
            every=1 << 30,
            keep_last=1,
            fingerprint="bench",
        )
        self.waited_after_save = 0.0
        """The next optimizer step's wait for the last save's background copy: stall (``copy_wait``)."""

    def before_update(self) -> None:
        """``train_step``'s ``wait_for_staging``, as in the trainer: after the backward, before the update."""
        self.waited_after_save += self.ckpt.before_update()

    def save(self, step: int) -> None:
        self.waited_after_save = 0.0
        self.ckpt.save(step, partial(self.state.snapshot, step))

    def done(self, step: int) -> bool:
        # What the trainer calls every step: polls the in-flight save (a save is never due here).
        self.ckpt.step(step, partial(self.state.snapshot, step), last=False)
        return self.ckpt.pending is None

    def cleanup(self) -> None:
        if dist.get_rank() == 0:
            for path in (self.root / "checkpoints").glob("step_*"):
                shutil.rmtree(path)

    def close(self) -> None:
        self.ckpt.writer.close()


def _local(obj: object) -> object:
    """The state dict with every DTensor replaced by this rank's local shard."""
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_local(v) for v in obj)
    return obj


class _TorchSave:
    """What a user writes by hand: each rank ``torch.save``s its local shards, then fsyncs."""

    def __init__(self, root: Path, state: TrainState, group: dist.ProcessGroup) -> None:
        self.root, self.state, self.group = root, state, group
        self.write_s: list[float] = []  # torch.save alone, without the fsync

    def save(self, step: int) -> None:
        model_sd, optim_sd = get_state_dict(self.state.model, self.state.optimizer)
        path = self.root / f"step_{step}" / f"rank{dist.get_rank()}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(_local({"model": model_sd, "optim": optim_sd}), f)
            f.flush()
            self.write_s.append(time.perf_counter() - t0)
            os.fsync(f.fileno())
        dist.barrier(group=self.group)  # the checkpoint exists once every rank's file does

    def done(self, step: int) -> bool:
        return True

    def cleanup(self) -> None:
        _remove_saves(self.root)

    def close(self) -> None:
        pass


class _DcpAsyncSave:
    """PyTorch's ``dcp.async_save`` with its own gloo group (it must not share FSDP's)."""

    def __init__(self, root: Path, state: TrainState, group: dist.ProcessGroup) -> None:
        self.root, self.state, self.group = root, state, group
        self.future = None

    def save(self, step: int) -> None:
        model_sd, optim_sd = get_state_dict(self.state.model, self.state.optimizer)
        target_dir = self.root / f"step_{step}"
        self.future = dcp.async_save(
            {"model": model_sd, "optim": optim_sd}, checkpoint_id=target_dir, process_group=self.group
        )

    def done(self, step: int) -> bool:
        if self.future is None or not self.future.done():
            return self.future is None
        self.future.result()  # raises if the background save failed
        self.future = None
        return True

    def cleanup(self) -> None:
        _remove_saves(self.root)

    def close(self) -> None:
        pass


def _remove_saves(root: Path) -> None:
    """Rank 0 deletes a method's saves between rounds."""
    if dist.get_rank() == 0:
        for path in root.glob("step_*"):
            shutil.rmtree(path)


def _all(flag: bool, group: dist.ProcessGroup) -> bool:
    """True when ``flag`` holds on every rank (the harness's own collective, the same for all methods)."""
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def worker(args: argparse.Namespace) -> None:
    """One rank: train, save with every method in interleaved rounds, record the timings."""
    params = QUICK if args.quick else FULL
    size: ModelSize = params["size"]
    rt = detect_runtime()
    init_process_group(rt, None, timeout_s=900)
    timeout = datetime.timedelta(seconds=900)
    ckpt_group = dist.new_group(backend="gloo", timeout=timeout)  # the Checkpointer's, as in the trainer
    dcp_group = dist.new_group(backend="gloo", timeout=timeout)  # dcp.async_save's own
    harness = dist.new_group(backend="gloo", timeout=timeout)

    async_writer = AsyncCheckpointWriter(
        cuda=False
    )  # before the state exists, as in the trainer: its worker is forked now
    if args.model:  # a model of the user's (hf:PATH, py:...), at the benchmark's batch and sequence length
        spec = build_fsdp_model(args.model, rt, seed=0)
    else:
        seed_everything(0)
        spec = shard_model(BuiltinModel(size), rt)
    optimizer = torch.optim.AdamW(spec.module.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    loader = TokenLoader(load_split(Path(args.data), "train"), size.seq_len, params["batch"], rt.rank, rt.world_size)
    state = TrainState(spec, optimizer, loader, RankMonitor(), ckpt_group)
    work = Path(args.work)
    methods = {
        "nvrx_async": _CheckpointerMethod(work / "nvrx_async", async_writer, state, ckpt_group),
        "torch_save": _TorchSave(work / "torch_save", state, ckpt_group),
        "dcp_save": _CheckpointerMethod(work / "dcp_save", SyncDcpWriter(), state, ckpt_group),
        "dcp_async_save": _DcpAsyncSave(work / "dcp_async_save", state, dcp_group),
    }

    step = 0

    def iteration(method: object | None) -> tuple[float, bool]:
        """One training step plus the method's per-step poll; (seconds, durable everywhere)."""
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        wait = method.before_update if isinstance(method, _CheckpointerMethod) else None
        train_step(state, 1e-4, 1.0, rt.device, wait_for_staging=wait)
        done = method.done(step) if method is not None else True
        return time.perf_counter() - t0, done

    iteration(None)  # creates the AdamW moments: the state is complete from here on
    for method in (
        methods.values()
    ):  # the per-step poll after that step, as in the trainer (the Checkpointer prepares its writer)
        method.done(step)
    records = []
    for rnd, name in interleaved(METHODS, params["rounds"]):
        method = methods[name]
        base = [iteration(None)[0] for _ in range(params["base_steps"])]
        t0 = time.perf_counter()
        method.save(step)
        stall = time.perf_counter() - t0
        inflight = []
        done = _all(method.done(step), harness)
        while not done and len(inflight) < MAX_INFLIGHT_STEPS:
            seconds, local_done = iteration(method)
            inflight.append(seconds)
            done = _all(local_done, harness)
        durable = time.perf_counter() - t0
        if not done:
            raise RuntimeError(f"{name}: not durable after {MAX_INFLIGHT_STEPS} steps")
        if (
            isinstance(method, _CheckpointerMethod) and method.waited_after_save
        ):  # the first step's wait for the copy: stall, not step
            stall += method.waited_after_save
            inflight[0] -= method.waited_after_save
        method.cleanup()
        dist.barrier(group=harness)
        records.append(
            {
                "round": rnd,
                "method": name,
                "stall_s": stall,
                "durable_s": durable,
                "base_step_s": base,
                "inflight_step_s": inflight,
            }
        )
    write_s = methods["torch_save"].write_s
    for method in methods.values():
        method.close()

    gathered: list = [None] * rt.world_size
    dist.gather_object(
        {"records": records, "torch_save_write_s": write_s}, gathered if rt.rank == 0 else None, dst=0, group=harness
    )
    if rt.rank == 0:
        state_bytes = sum(
            t.numel() * t.element_size() * rt.world_size
            for t in _flat_tensors(_local(get_state_dict(spec.module, optimizer)))
        )  # every rank holds an equal shard
        parameters = sum(p.numel() for p in spec.module.parameters())  # (the global shapes: DTensors)
        Path(args.out).write_text(json.dumps({"ranks": gathered, "state_bytes": state_bytes, "parameters": parameters}))
    dist.destroy_process_group()


def _flat_tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _flat_tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _flat_tensors(v)]
    return []


# ---------------------------------------------------------------- the driver
def save_phases(method_dir: Path) -> list[dict[str, float]]:
    """Each save's phases (seconds, rank 0), in order, from the ``checkpoint`` events the
    ``Checkpointer`` wrote in ``method_dir`` (the first is the warm-up round's).
    """
    return [e.phases or {} for e in select(read_events(method_dir), Checkpoint)]


def median_phases(saves: list[dict[str, float]]) -> dict[str, float]:
    """The median of each phase over ``saves``, in the phases' order."""
    names = list(dict.fromkeys(k for s in saves for k in s))
    return {k: median([s[k] for s in saves if k in s]) for k in names}


def summarize(
    raw: dict, params: dict, phases: dict[str, list[dict[str, float]]] | None = None, *, model: str = ""
) -> dict:
    """Per method: medians over the measured rounds (slowest rank per save), warm-up apart;
    ``phases``: the saves' phases of the ``PHASED`` methods (see :func:`save_phases`).
    """
    ranks = [r["records"] for r in raw["ranks"]]
    methods: dict[str, dict] = {}
    for name in METHODS:
        saves = []
        for i, rec in enumerate(ranks[0]):
            if rec["method"] != name:
                continue
            per_rank = [rank[i] for rank in ranks]
            saves.append(
                {
                    "round": rec["round"],
                    "stall_s": max(r["stall_s"] for r in per_rank),
                    "durable_s": max(r["durable_s"] for r in per_rank),
                    "base_step_s": median(rec["base_step_s"]),
                    "inflight_step_s": rec["inflight_step_s"],
                }
            )
        warm, measured = saves[0], saves[1:]
        base = median([s["base_step_s"] for s in measured])
        inflight = median([t for s in measured for t in s["inflight_step_s"]])
        methods[name] = {
            "saves": len(measured),
            "stall_s": median([s["stall_s"] for s in measured]),
            "durable_s": median([s["durable_s"] for s in measured]),
            "step_s": base,
            "inflight_step_s": inflight,
            "slowdown": ratio(inflight, base),
            "inflight_steps": median([len(s["inflight_step_s"]) for s in measured]),
            "warmup_stall_s": warm["stall_s"],
            "warmup_durable_s": warm["durable_s"],
            "warmup_stall_vs_steady": ratio(warm["stall_s"], median([s["stall_s"] for s in measured])),
        }
        if phases and phases.get(name):
            methods[name] |= {"phases": median_phases(phases[name][1:]), "warmup_phases": phases[name][0]}
    ref = methods[REFERENCE]["stall_s"]
    write_s = median([w for r in raw["ranks"] for w in r["torch_save_write_s"][1:]])
    methods[REFERENCE]["write_s_without_fsync"] = write_s
    for m in methods.values():
        m["stall_ratio"] = ratio(m["stall_s"], ref)
        m["stall_ratio_vs_unsynced_torch_save"] = ratio(m["stall_s"], write_s)
    ours = methods["nvrx_async"]
    return {
        "benchmark": "checkpoint",
        "params": {
            "model": model
            or {"dim": params["size"].dim, "layers": params["size"].layers, "seq_len": params["size"].seq_len},
            "parameters": raw.get("parameters") or size_parameters(params["size"]),
            "state_bytes": raw["state_bytes"],
            "batch_size": params["batch"],
            "ranks": len(raw["ranks"]),
            "rounds": params["rounds"],
            "reference": REFERENCE,
        },
        "methods": methods,
        "targets": [
            target("nvrx_async stall / torch_save stall <= 0.05", ours["stall_ratio"], 0.05),
            target(
                "nvrx_async stall / dcp_async_save stall <= 1",
                ratio(ours["stall_s"], methods["dcp_async_save"]["stall_s"]),
                1.0,
            ),
            target("nvrx_async first-save stall / steady stall <= 2", ours["warmup_stall_vs_steady"], 2.0),
            target("nvrx_async step-time slowdown while writing <= 1.25", ours["slowdown"], 1.25),
        ],
    }


def run(quick: bool, work: Path, data: Path, model: str = "") -> dict:
    """Run the benchmark on 2 ranks under torchrun and summarize it (``model``: a ``--model``
    to save instead of the built-in size of ``FULL`` or ``QUICK``)."""
    work = fresh_dir(work / "checkpoint")
    out = work / "raw.json"
    args = ["--data", str(data), "--work", str(work), "--out", str(out), *(["--quick"] if quick else [])]
    args += ["--model", model] if model else []
    code, _ = run_torchrun("bench.checkpoint", args, work / "torchrun.log", timeout=3600)
    if code or not out.exists():
        raise RuntimeError(f"checkpoint benchmark failed (exit {code}); see {work / 'torchrun.log'}")
    phases = {name: save_phases(work / name) for name in PHASED}
    result = summarize(json.loads(out.read_text()), QUICK if quick else FULL, phases, model=model)
    shutil.rmtree(work / "nvrx_async", ignore_errors=True)
    return result


def show(result: dict) -> None:
    """Print the result as a table and the targets under it."""
    p = result["params"]
    rows = []
    for name, m in result["methods"].items():
        rows.append(
            [
                name,
                fmt(m["stall_s"], " s"),
                fmt(m["stall_ratio"], digits=3),
                fmt(m["durable_s"], " s", 2),
                fmt(m["step_s"], " s"),
                fmt(m["slowdown"], "x", 2),
                fmt(m["warmup_stall_s"], " s"),
            ]
        )
    cols = ["method", "stall", "stall ratio", "durable", "step", "slowdown", "warm-up stall"]
    title = (
        f"checkpoint: {p['state_bytes'] / 2**30:.2f} GiB state, {p['ranks']} ranks, {p['rounds'] - 1} rounds + warm-up"
    )
    print_table(title, cols, rows)
    phased = [(name, m) for name, m in result["methods"].items() if m.get("phases")]
    names = list(dict.fromkeys(k for _, m in phased for k in [*m["warmup_phases"], *m["phases"]]))
    columns = [
        (f"{name} {label}", p)
        for name, m in phased
        for label, p in (("steady", m["phases"]), ("first", m["warmup_phases"]))
    ]
    rows = [[k, *(fmt(p.get(k)) for _, p in columns)] for k in names]
    print_table(
        "checkpoint: seconds per phase of a save (rank 0, its checkpoint events)",
        ["phase", *(c for c, _ in columns)],
        rows,
    )
    print_targets(result["targets"])


def main() -> None:
    """Worker entry point (started by torchrun from :func:`run`)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="")
    worker(parser.parse_args())


if __name__ == "__main__":  # required: NVRx's checkpoint worker is started with spawn
    main()
