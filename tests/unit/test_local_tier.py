"""The local tier (``--local-ckpt-every``): each rank's snapshots in node memory, checksummed,
at most two per rank; recoveries resume from the newest one every rank can load, the trajectory
stays the uninterrupted one bit for bit, and a completed run leaves nothing in /dev/shm.

Here one rank in this process and the launcher's checks; real jobs and the CLI:
tests/integration/test_local_tier_runs.py.
"""

from __future__ import annotations

import datetime
import errno
import io
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from trainer.data.loader import TokenLoader
from trainer.errors import ParameterError
from trainer.events import Checkpoint, CheckpointFailed, EventLog, Restart, RunWarning, read_events, summarize
from trainer.launch import WORKSPACE_MOUNT
from trainer.launch.k8s import ClusterOptions, build_pytorchjob, quantity_bytes
from trainer.launch.local import check_local_replicas, check_local_tier, local_tier_bytes
from trainer.launch.spec import LaunchSpec
from trainer.rank.config import MODEL_SIZES, TrainConfig, replica_cliques
from trainer.rank.packing import pack as _pack
from trainer.rank.packing import unpack as _unpack
from trainer.rank.resilience import LocalTier, RankMonitor
from trainer.rank.runtime import Runtime, build_fsdp_model
from trainer.rank.state import TrainState, _local_shards
from trainer.rank.train import train_step


def snapshot_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("iter_*_local.pt"))


# ------------------------------------------------------------------ one rank, in this process
@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    """A real gloo world of one rank (this process), with a checkpoint group beside the default."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def test_snapshots_are_bounded_checksummed_and_a_corrupt_one_is_skipped(
    one_rank: dist.ProcessGroup, tmp_path: Path
) -> None:
    (tmp_path / "run").mkdir()
    tier = LocalTier(
        tmp_path / "tier" / "run", every=2, group=one_rank, save_group=one_rank, events=EventLog(tmp_path / "run", 0)
    )
    witness = tmp_path / "witness"
    for step in range(1, 8):
        tier.step(step, lambda step=step: {"w": torch.full((4,), float(step)), "rank": {"step": step}})
        if step == 2:
            tier.finish()
            os.link(tier.directory / "iter_0000002_0_local.pt", witness)  # holds its inode: no new file can take it
    tier.finish()  # the write in flight (step 6): done, and it counts
    assert snapshot_names(tier.directory) == ["iter_0000004_0_local.pt", "iter_0000006_0_local.pt"]  # at most two
    assert sorted(p.name for p in tier.directory.iterdir() if p.suffix != ".sha256") == snapshot_names(tier.directory)
    assert (tier.directory / "iter_0000006_0_local.pt").samefile(witness)  # step 2's file (its pages) was reused
    assert all((tier.directory / f"{name}.sha256").is_file() for name in snapshot_names(tier.directory))
    (tier.directory / "iter_0000008_0_local.pt").write_bytes(b"torn: no checksum written after it")
    assert tier.find_latest() == (6, "local")  # a file without its sidecar is not a snapshot
    assert torch.equal(tier.load(6)["w"], torch.full((4,), 6.0))

    newest = tier.directory / "iter_0000006_0_local.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert tier.find_latest() == (4, "local")
    (skipped,) = [e for e in read_events(tmp_path / "run") if isinstance(e, RunWarning)]
    assert (skipped.kind, skipped.step) == ("local_snapshot_skipped", 6) and "checksum" in skipped.reason
    tier.step(8, lambda: {"w": torch.zeros(1), "rank": {}})  # prunes down to the one resumed from
    tier.finish()
    assert snapshot_names(tier.directory) == ["iter_0000004_0_local.pt", "iter_0000008_0_local.pt"]
    assert tier.find_latest() == (8, "local")  # written over a longer file: nothing of that one is left in it
    assert torch.equal(tier.load(8)["w"], torch.zeros(1))

    published = [e for e in read_events(tmp_path / "run") if isinstance(e, Checkpoint)]
    assert [(e.step, e.tier) for e in published] == [(2, "local"), (4, "local"), (6, "local"), (8, "local")]
    assert summarize(read_events(tmp_path / "run"))["checkpoints"] == 0  # the durable figures count durable ones only
    tier.remove()
    assert not tier.root.exists()


def test_the_background_write_keeps_the_state_it_was_handed(one_rank: dist.ProcessGroup, tmp_path: Path) -> None:
    """The snapshot is copied and written beside training, which changes the live tensors in place
    once the copy is taken: what is written is the state when the save was handed over. The next attempt (an in-process
    restart, which never agreed on that write) waits for it before it looks at the snapshots."""
    (tmp_path / "run").mkdir()

    def tier() -> LocalTier:
        return LocalTier(
            tmp_path / "tier" / "run",
            every=1,
            group=one_rank,
            save_group=one_rank,
            events=EventLog(tmp_path / "run", 0),
        )

    live = torch.arange(1 << 22, dtype=torch.float32)  # 16 MiB
    first = tier()
    first.step(1, lambda: {"w": live, "rank": {"step": 1}})
    first.before_update()  # the next step's update waits for the copy, not for the write
    assert first._pending.copied.is_set()
    live.add_(1.0)  # the next optimizer step, while the write may still be going
    again = tier()
    assert again.find_latest() == (1, "local")
    assert torch.equal(again.load(1)["w"], torch.arange(1 << 22, dtype=torch.float32))


def test_the_steps_all_reduce_settles_a_write_without_a_collective_of_its_own(
    one_rank: dist.ProcessGroup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank votes on its write in flight in the step's own all-reduce (:meth:`ballot`, summed
    by ``train_step``). Once every rank's write ended, the next save counts it with no wait and no
    collective; a write still going on some rank is agreed on as before, with a collective."""
    (tmp_path / "run").mkdir()
    tier = LocalTier(
        tmp_path / "tier" / "run", every=1, group=one_rank, save_group=one_rank, events=EventLog(tmp_path / "run", 0)
    )
    calls: list[object] = []
    real_all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(k.get("group")) or real_all_reduce(*a, **k))

    tier.step(1, lambda: {"w": torch.ones(4), "rank": {"step": 1}})
    tier._pending.ended.wait()
    assert tier.ballot() == [1.0, 0.0, 0.0]  # ended, not failed, not out of room
    tier.tally([1.0, 0.0, 0.0])  # what the all-reduce of a world of one returns
    tier.step(2, lambda: {"w": torch.full((4,), 2.0), "rank": {"step": 2}})  # counts step 1: no collective
    assert calls == []
    assert tier.ballot() in ([0.0, 0.0, 0.0], [1.0, 0.0, 0.0])  # step 2's write: maybe still going
    tier.tally([0.0, 0.0, 0.0])  # some rank's write still going: not settled
    tier.finish()
    assert calls == [one_rank]  # agreed on with a collective of the save group

    first, second = [e for e in read_events(tmp_path / "run") if isinstance(e, Checkpoint)]
    assert (first.step, second.step) == (1, 2)
    assert {"plan", "copy", "write"} <= set(first.phases) and "agree" not in first.phases
    assert {"plan", "copy", "write", "wait", "agree"} <= set(second.phases)
    assert tier.find_latest() == (2, "local")

    def broken() -> dict:
        return {"w": torch.ones(4), "rank": {"step": 3}, "bad": object.__new__(_Unpicklable)}

    tier.step(3, broken)
    tier._pending.ended.wait()
    assert tier.ballot() == [1.0, 1.0, 0.0]  # failed, with room
    tier.tally([1.0, 1.0, 0.0])
    tier.finish()
    (failed,) = [e for e in read_events(tmp_path / "run") if isinstance(e, CheckpointFailed)]
    assert failed.step == 3 and failed.tier == "local" and "pickle" in failed.error
    assert tier.newest == 2 and tier.off is None  # a failed write is retried at the next one
    assert train_step_sums(lambda: [1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]


def test_a_write_that_finds_no_room_after_the_save_turns_the_tier_off(
    one_rank: dist.ProcessGroup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write still going when the next save agrees on it, which then finds no room: the tier
    steps aside (its error is read once the write ended, not before)."""
    (tmp_path / "run").mkdir()
    tier = LocalTier(
        tmp_path / "tier" / "run", every=1, group=one_rank, save_group=one_rank, events=EventLog(tmp_path / "run", 0)
    )
    release = threading.Event()

    def full(snapshots: dict) -> None:
        release.wait(30)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier.manager, "_save_fn", full)
    tier.step(1, lambda: {"w": torch.ones(4), "rank": {"step": 1}})
    tier.tally(tier.ballot())  # still writing: not settled
    threading.Timer(0.2, release.set).start()
    tier.finish()
    assert tier.off is not None and "No space left" in tier.off
    (off,) = [e for e in read_events(tmp_path / "run") if isinstance(e, RunWarning)]
    assert off.kind == "local_tier_off" and off.step == 1
    assert not [e for e in read_events(tmp_path / "run") if isinstance(e, CheckpointFailed)]


class _Unpicklable:
    def __reduce__(self) -> tuple:
        raise TypeError("cannot pickle this")


def train_step_sums(ballot: object) -> list[float]:
    """The sums ``train_step`` returns for ``ballot`` (a world of one: its own votes)."""
    spec = build_fsdp_model("tiny", Runtime(torch.device("cpu"), "gloo", rank=0, local_rank=0, world_size=1), seed=0)
    size = MODEL_SIZES["tiny"]
    loader = TokenLoader(np.arange(5000, dtype=np.uint16) % size.vocab_size, size.seq_len, 2, rank=0, world_size=1)
    state = TrainState(spec, torch.optim.AdamW(spec.module.parameters()), loader, RankMonitor(), None)
    _, stop, sums = train_step(state, lr=1e-3, grad_clip=1.0, device=torch.device("cpu"), ballot=ballot)
    assert stop is False
    return sums


def test_a_snapshot_is_packed_into_one_buffer_and_unpacked_exactly() -> None:
    """Every tensor of the state (any dtype, shape, stride) goes into one reused byte buffer, and
    comes back through torch.save / torch.load (weights only) equal, in its place in the tree."""
    live = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "tensors": {
            "w": live.t(),
            "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
            "step": torch.tensor(7.0),
            "none": torch.empty(0),
        },
        "rank": {
            "step": 7,
            "rng": {"torch": torch.get_rng_state()},
            "loader": [3, {"epoch": torch.tensor([2], dtype=torch.int64)}],
        },
    }
    buffers: dict = {}
    packed = _pack(state, buffers)
    assert [t for t in _tensors(packed)] == [packed["data"]]  # one tensor to save, send and hash
    saved = io.BytesIO()
    torch.save(packed, saved)
    back = _unpack(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    assert back["rank"]["step"] == 7 and back["rank"]["loader"][0] == 3
    for (path, original), (_, restored) in zip(_leaves(state), _leaves(back), strict=True):
        assert (original.dtype, original.shape) == (restored.dtype, restored.shape) and torch.equal(
            original, restored
        ), path
    torch.set_rng_state(back["rank"]["rng"]["torch"])  # the generator resumes where the saved state left it
    resumed = torch.rand(8)
    torch.set_rng_state(state["rank"]["rng"]["torch"])
    assert torch.equal(torch.rand(8), resumed)  # (a view into the buffer would be misread by torch)

    data = packed["data"]
    starts = [offset for *_, offset in packed["layout"]] + [data.numel()]
    ends = [offset + math.prod(shape) * dtype.itemsize for _, dtype, shape, offset in packed["layout"]]
    gaps = [data[end:start] for end, start in zip(ends, starts[1:], strict=True)]
    assert not any(gap.any() for gap in gaps)  # zeros between tensors: the same state, the same bytes
    live.add_(1.0)
    assert _pack(state, buffers)["data"] is data  # the same layout: the buffer is reused, the values new
    assert torch.equal(_unpack(_pack(state, buffers))["tensors"]["w"], live.t())
    assert _pack({"w": torch.zeros(3)}, buffers)["data"] is not data  # another layout: a new buffer


def test_the_snapshot_maps_the_live_state_once_and_follows_it(one_rank: dist.ProcessGroup) -> None:
    """The local snapshot reuses its mapping of the live tensors from step to step: at every step,
    and after a restore, it holds what DCP's ``get_state_dict`` maps to then, learning rate included."""
    size = MODEL_SIZES["tiny"]
    spec = build_fsdp_model("tiny", Runtime(torch.device("cpu"), "gloo", rank=0, local_rank=0, world_size=1), seed=0)
    optimizer = torch.optim.AdamW(spec.module.parameters())
    loader = TokenLoader(np.arange(5000, dtype=np.uint16) % size.vocab_size, size.seq_len, 2, rank=0, world_size=1)
    state = TrainState(spec, optimizer, loader, RankMonitor(), one_rank)

    def mapped_now(step: int) -> dict:
        tensors, rank_state = state.snapshot(step)
        return {"tensors": _local_shards(tensors), "rank": rank_state}

    def same(a: dict, b: dict) -> bool:
        structure = [
            (packed["skeleton"], packed["layout"]) for packed in (_pack(a, {}), _pack(b, {}))
        ]  # values, names, dtypes, shapes
        return structure[0] == structure[1] and all(
            torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b), strict=True)
        )

    assert same(state.local_snapshot(0), mapped_now(0))  # before the first step (DCP makes the optimizer's state)
    for step in (1, 2, 3):
        train_step(state, lr=1e-3 * step, grad_clip=1.0, device=torch.device("cpu"))
        assert same(state.local_snapshot(step), mapped_now(step))
    saved = _unpack(_pack(state.local_snapshot(3), {}))  # a copy, as the tier keeps it
    train_step(state, lr=4e-3, grad_clip=1.0, device=torch.device("cpu"))
    state.restore(saved)
    assert same(state.local_snapshot(3), saved) and same(saved, mapped_now(3))
    train_step(state, lr=4e-3, grad_clip=1.0, device=torch.device("cpu"))
    assert same(state.local_snapshot(4), mapped_now(4))


def _leaves(tree: object, path: tuple = ()) -> list[tuple[tuple, object]]:
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(tree, list):
        return [leaf for i, v in enumerate(tree) for leaf in _leaves(v, (*path, i))]
    return [(path, tree)] if isinstance(tree, torch.Tensor) else []


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for _, t in _leaves(tree)]


# ------------------------------------------------------------------ peer replicas
def test_replicas_default_to_one_with_another_node_and_a_local_tier() -> None:
    local = TrainConfig(data="d", run_dir="r", local_ckpt_every=1)
    assert [local.replicas(nnodes) for nnodes in (1, 2, 3)] == [0, 1, 1]
    assert (
        TrainConfig(data="d", run_dir="r", local_ckpt_every=0).replicas(2) == 0
    )  # no local tier: nothing to replicate
    assert TrainConfig(data="d", run_dir="r").replicas(2) == 1  # the tiny model's tier is on by default
    assert TrainConfig(data="d", run_dir="r", local_ckpt_every=1, local_replicas=0).replicas(2) == 0
    assert TrainConfig(data="d", run_dir="r", local_ckpt_every=1, local_replicas=2).replicas(3) == 2


def test_the_local_tier_is_on_every_step_by_default_up_to_the_small_model() -> None:
    """The default rule (-1): a snapshot every step for the models whose two snapshots fit any node
    (about 100 MiB at most), off for larger ones; what is given is kept."""
    by_default = {model: TrainConfig(data="d", run_dir="r", model=model).local_ckpt_every for model in MODEL_SIZES}
    assert by_default == {"tiny": 1, "small": 1, "base": 0, "large": 0, "1b": 0}
    assert TrainConfig(data="d", run_dir="r", model="base", local_ckpt_every=5).local_ckpt_every == 5
    assert TrainConfig(data="d", run_dir="r", local_ckpt_every=0).local_ckpt_every == 0
    assert "--local-ckpt-every 1" in " ".join(
        TrainConfig(data="d", run_dir="r", model="small").to_argv()
    )  # ranks get the rule's value


def test_cliques_hold_each_rank_on_other_nodes() -> None:
    """The same local rank on ``replicas + 1`` consecutive nodes; the last clique takes the nodes
    left over; without replicas each rank alone."""
    assert replica_cliques(2, 1, 1) == [[0, 1]]
    assert replica_cliques(2, 2, 1) == [[0, 2], [1, 3]]  # ranks 0, 1 on node 0; 2, 3 on node 1
    assert replica_cliques(4, 1, 1) == [[0, 1], [2, 3]]
    assert replica_cliques(3, 1, 1) == [[0, 1, 2]]
    assert replica_cliques(5, 2, 2) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert replica_cliques(1, 2, 0) == [[0], [1]]
    for nnodes, nproc, replicas in ((2, 2, 1), (4, 2, 1), (5, 3, 2), (7, 1, 3)):
        cliques = replica_cliques(nnodes, nproc, replicas)
        assert sorted(r for c in cliques for r in c) == list(range(nnodes * nproc))  # every rank in one clique
        for clique in cliques:
            nodes = [rank // nproc for rank in clique]
            assert len(set(nodes)) == len(nodes) >= replicas + 1  # each copy on another node


def test_replicas_are_checked_as_pipeline_parameters_too() -> None:
    from trainer.launch.local import job_from_parameters

    params = {"nnodes": 1, "nproc_per_node": 2, "max_restarts": 3, "local_ckpt_every": 1, "local_replicas": 1}
    with pytest.raises(ParameterError, match="^local_replicas: 1 replica\\(s\\) of local snapshots need other nodes"):
        job_from_parameters(params, data="d", run_dir="r")
    cfg, spec = job_from_parameters({**params, "nnodes": 2, "local_replicas": -1}, data="d", run_dir="r")
    check_local_replicas(cfg, spec)
    assert cfg.replicas(spec.nnodes) == 1


def test_dev_shm_is_sized_for_the_replicas_a_node_holds() -> None:
    def need(nnodes: int, replicas: int) -> int:
        cfg = TrainConfig(
            data="d", run_dir="r", model="base", local_ckpt_every=1, local_replicas=replicas, world_size=2 * nnodes
        )
        return local_tier_bytes(cfg, LaunchSpec(nnodes=nnodes, nproc_per_node=2))

    assert need(2, 1) == pytest.approx(2 * need(2, 0), abs=2)  # each rank holds its own and one peer's
    assert need(3, 1) == pytest.approx(3 * need(3, 0), abs=2)  # the last clique takes the third node: 3 copies
    cfg = TrainConfig(data="d", run_dir="r", model="base", local_ckpt_every=1, world_size=4)
    with pytest.raises(ParameterError, match="and of the peers they hold replicas of, --local-replicas 1"):
        check_local_tier(cfg, LaunchSpec(nnodes=2, nproc_per_node=2), free_bytes=1)


def test_corrupting_a_local_snapshot_needs_one() -> None:
    with pytest.raises(ParameterError, match="^--fault: corrupt-local@5:1 corrupts a local snapshot"):
        TrainConfig(data="d", run_dir="r", fault="corrupt-local@5:1", local_ckpt_every=0)
    with pytest.raises(ParameterError, match="needs --local-ckpt-every below step 5"):
        TrainConfig(data="d", run_dir="r", fault="corrupt-local@5:1", local_ckpt_every=5)
    TrainConfig(data="d", run_dir="r", fault="corrupt-local@5:1", local_ckpt_every=1)


def test_a_dev_shm_too_small_for_two_snapshots_is_refused_with_the_numbers() -> None:
    cfg, spec = (
        TrainConfig(data="d", run_dir="r", model="base", local_ckpt_every=1),
        LaunchSpec(nnodes=1, nproc_per_node=2),
    )
    need = local_tier_bytes(cfg, spec)
    assert need > 2 * 2 * 85_000_000 * 3 * 4 / 2  # two snapshots of each rank's params + 2 moments, fp32
    check_local_tier(cfg, spec, free_bytes=need)
    with pytest.raises(ParameterError) as refused:
        check_local_tier(cfg, spec, free_bytes=need - 1)
    message = str(refused.value)
    assert message.startswith("--local-ckpt-every: 2 local snapshots of each of 2 ranks on a node need ")
    assert f"{need / 2**20:,.0f} MiB" in message and "(model base, world size 2)" in message


def test_the_pytorchjob_sizes_dev_shm_for_the_local_tier() -> None:
    def shm_limit(local_every: int) -> str:
        cfg = TrainConfig(
            data=f"{WORKSPACE_MOUNT}/d", run_dir=f"{WORKSPACE_MOUNT}/r", model="small", local_ckpt_every=local_every
        )
        job = build_pytorchjob(
            cfg, LaunchSpec(nnodes=2, nproc_per_node=2), ClusterOptions(name="job", image="img:1", shm_size="1Gi")
        )
        (volume,) = [v for v in job.spec.pytorch_replica_specs["Worker"].template.spec.volumes if v.name == "dshm"]
        return volume.empty_dir.size_limit

    assert shm_limit(0) == "1Gi"
    tier = local_tier_bytes(
        TrainConfig(data="d", run_dir="r", model="small", local_ckpt_every=1), LaunchSpec(nnodes=2, nproc_per_node=2)
    )
    assert 0 <= quantity_bytes(shm_limit(1)) - (2**30 + tier) < 2**20


def test_local_snapshots_are_reported_apart_from_the_durable_checkpoints() -> None:
    """MLflow, the notebook and the run summary keep the durable tier's figures its own."""
    import pandas as pd

    from trainer.events import RunStart, Step
    from trainer.results.compare import RunRecord, checkpoint_blocking, recoveries, timeline
    from trainer.results.tracking import metric_points

    def ckpt(t: float, step: int, tier: str) -> Checkpoint:
        return Checkpoint(
            time=t,
            step=step,
            mode="async" if tier == "durable" else "sync",
            tier=tier,
            blocking_s=0.1,
            total_s=0.2,
            bytes=10,
        )

    events = [
        RunStart(time=100.0, config={}, resumed_from_step=0, world_size=2),
        Step(time=101.0, step=1, loss=5.0, step_time_s=0.5),
        ckpt(101.1, 1, "local"),
        Step(time=102.0, step=2, loss=4.0, step_time_s=0.5),
        ckpt(102.1, 2, "durable"),
        Restart(
            time=105.0, layer="in_process", attempt=1, resumed_from_step=2, lost_steps=0, recovery_s=2.0, source="local"
        ),
    ]
    keys = {key for key, *_ in metric_points(events)}
    assert {"local_ckpt_blocking_s", "ckpt_blocking_s"} <= keys
    assert [p[3] for p in metric_points(events) if p[0] == "ckpt_blocking_s"] == [2]  # ckpt_* is the durable tier's
    run = RunRecord(run_id="r", name="run", experiment="e", params={}, events=events)
    assert list(checkpoint_blocking([run])["kind"]) == ["local", "async"]
    assert list(timeline(run).checkpoints["step"]) == [2]  # the timeline's bands: durable checkpoints
    assert list(recoveries([run])["source"]) == ["local"]
    assert isinstance(checkpoint_blocking([]), pd.DataFrame)
