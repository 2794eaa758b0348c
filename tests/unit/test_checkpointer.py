"""The checkpoint policy in milliseconds (a fake writer, one process on a 1-rank gloo group), and
the writers' parts that run in this process. The NVRx writer's life cycle across attempts
(its real background worker, a process of its own): tests/integration/test_checkpointer_runs.py.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from trainer.checkpoint import (
    CHECKPOINTS,
    MANIFEST,
    SIGNING_KEY_ENV,
    Checkpointer,
    CheckpointError,
    CheckpointWriteError,
    SaveHooks,
    SyncDcpWriter,
    latest_checkpoint,
    published_checkpoints,
    step_dir_name,
    verify_checkpoint,
    write_rank_checksums,
)
from trainer.checkpoint.checkpointer import UnsignedResumeError
from trainer.events import SAVE_PHASES, Checkpoint, CheckpointFailed, EventLog, RunWarning, read_events, select
from trainer.fsutil import file_sha256
from trainer.storage.mirror import CheckpointMirror


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def new_group() -> dist.ProcessGroup:
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))


class FakeWriter:
    """Leaves the files a rank's DCP shard would (no tensors); its write stays busy for
    ``busy_polls`` polls and fails when ``fail`` is set, like a worker that runs out of disk.
    """

    mode = "async"

    def __init__(self) -> None:
        self.busy_polls = 0
        self.fail = False
        self.started: dict[dist.ProcessGroup, SaveHooks] = {}
        self.prepared: list[dict] = []

    def start(self, state_dict: dict, directory: Path, group: dist.ProcessGroup, hooks: SaveHooks) -> None:
        assert group not in self.started, "a save started while one was in flight"
        hooks.on_phase("stage")
        hooks.on_phase("plan")
        (directory / "__0_0.distcp").write_bytes(repr(state_dict).encode())
        (directory / ".metadata").write_bytes(
            pickle.dumps(Metadata(state_dict_metadata={}))
        )  # DCP's, describing nothing
        write_rank_checksums(directory, 0)
        self.started[group] = hooks
        hooks.on_phase("write")

    def wait_copied(self) -> None:
        """Nothing copied in the background: the state is written in :meth:`start`."""

    def prepare(
        self,
        state_dict: dict,
        directory: Path,
        group: dist.ProcessGroup,
        hooks: SaveHooks,
        plan_group: dist.ProcessGroup,
    ) -> None:
        self.prepared.append(state_dict)

    def poll(self, group: dist.ProcessGroup) -> bool:
        if self.busy_polls:
            self.busy_polls -= 1
            return False
        hooks = self.started.pop(group, None)
        if hooks is not None:
            hooks.on_phase("finalize")
            if self.fail:
                self.fail = False
                raise CheckpointWriteError("background write failed: no space left on device")
        return True

    def close(self) -> None:
        pass


def checkpointer(run_dir: Path, writer: object, **kw: object) -> Checkpointer:
    """A Checkpointer on a fresh group: each call is a new attempt of the training function."""
    options = {"every": 3, "keep_last": 2, **kw}
    return Checkpointer(
        run_dir, writer=writer, group=new_group(), events=EventLog(run_dir, 0), fingerprint="f", **options
    )


def state(step: int) -> tuple[dict, dict]:
    return {"model": {"w": step}}, {"step": step}


def run_steps(ckpt: Checkpointer, last: int) -> None:
    for step in range(1, last + 1):
        ckpt.step(step, lambda step=step: state(step), last=step == last)


def saved(run_dir: Path, kind: type[Checkpoint | CheckpointFailed] = Checkpoint) -> list[int]:
    return [e.step for e in select(read_events(run_dir), kind)]


def test_saves_every_interval_and_the_last_step_keeping_the_newest(one_rank: None, tmp_path: Path) -> None:
    run_steps(checkpointer(tmp_path, FakeWriter()), last=10)
    assert saved(tmp_path) == [3, 6, 9, 10]
    assert [step for step, _ in published_checkpoints(tmp_path / CHECKPOINTS)] == [9, 10]
    assert latest_checkpoint(tmp_path).name == step_dir_name(10)
    verify_checkpoint(latest_checkpoint(tmp_path), fingerprint="f", world_size=1)
    assert not list((tmp_path / CHECKPOINTS).glob("*.tmp*"))


def test_a_failed_write_is_reported_and_the_next_interval_saves_again(one_rank: None, tmp_path: Path) -> None:
    writer = FakeWriter()
    ckpt = checkpointer(tmp_path, writer)
    writer.fail = True
    run_steps(ckpt, last=7)
    assert saved(tmp_path, CheckpointFailed) == [3]
    assert saved(tmp_path) == [6, 7]
    assert not list((tmp_path / CHECKPOINTS).glob("*.tmp*")), "the failed save's files are removed"


def test_a_save_waits_until_nothing_is_being_written(one_rank: None, tmp_path: Path) -> None:
    """An earlier attempt's write still running: the first save waits for it, beating the
    heartbeat, instead of staging into buffers the worker is still reading."""
    writer, beats = FakeWriter(), []
    ckpt = checkpointer(tmp_path, writer, heartbeat=lambda: beats.append(1))
    writer.busy_polls = 3
    ckpt.save(3, lambda: state(3))
    assert len(beats) == 3 and writer.started
    ckpt.finish()
    assert saved(tmp_path) == [3]


def test_resume_repairs_a_stale_latest(one_rank: None, tmp_path: Path) -> None:
    """Rank 0 died between publishing step 6 and moving ``latest``: the next start resumes from
    step 6 and points ``latest`` at it."""
    run_steps(checkpointer(tmp_path, FakeWriter()), last=6)
    (tmp_path / CHECKPOINTS / "latest").write_text(step_dir_name(3) + "\n")
    loaded = []
    assert checkpointer(tmp_path, FakeWriter()).load_latest(loaded.append) == 6
    assert loaded == [tmp_path / CHECKPOINTS / step_dir_name(6)]
    assert latest_checkpoint(tmp_path).name == step_dir_name(6)
    (warning,) = select(read_events(tmp_path), RunWarning)
    assert warning.kind == "latest_repaired" and warning.was == step_dir_name(3)


def test_publication_is_atomic_for_in_process_restart(one_rank: None, tmp_path: Path) -> None:
    """Rank 0 publishes inside ``atomic()``: another rank's fault cannot interrupt it between the
    rename and the move of ``latest`` (in-process restart raises asynchronously elsewhere)."""
    inside, seen = [], []

    @contextlib.contextmanager
    def atomic() -> Iterator[None]:
        inside.append(True)
        yield
        inside.pop()

    ckpt = checkpointer(
        tmp_path, FakeWriter(), atomic=atomic, on_published=lambda path: seen.append((path.name, bool(inside)))
    )
    run_steps(ckpt, last=3)
    assert seen == [(step_dir_name(3), True)] and not inside


def test_each_phase_reaches_the_hook_in_order(one_rank: None, tmp_path: Path) -> None:
    phases = []
    run_steps(checkpointer(tmp_path, FakeWriter(), on_phase=lambda step, phase: phases.append((step, phase))), last=3)
    assert phases == [(3, phase) for phase in SAVE_PHASES]


def test_the_writer_is_prepared_once_per_attempt_before_its_first_save(one_rank: None, tmp_path: Path) -> None:
    """After the attempt's first step (the state is complete from there), not at a save."""
    writer = FakeWriter()
    run_steps(checkpointer(tmp_path, writer), 7)
    assert writer.prepared == [state(1)[0]]  # at step 1 only: step 3 is the first save
    first, *later = select(read_events(tmp_path), Checkpoint)
    assert next(iter(first.phases)) == "prepare" and first.phases["prepare"] < first.total_s
    assert all("prepare" not in c.phases for c in later)
    run_steps(checkpointer(tmp_path / "b", writer, every=1), 2)  # every step a save: nothing to prepare apart
    assert len(writer.prepared) == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_copy_to_staging_that_fails_fails_the_write_it_was_for() -> None:
    """The worker writes only after the copy it waits for has ended well: a copy that raises
    (here, a buffer of the wrong shape) makes that write fail, and a later copy is waited for anew."""
    from trainer.rank.resilience import _BackgroundCopy, _wait_for_copy

    copied = torch.zeros(2, dtype=torch.int64)
    buffer = torch.zeros(4)
    _BackgroundCopy([(buffer, torch.ones(4))], copied, 1).wait()
    _wait_for_copy(copied, 1)
    assert torch.equal(buffer, torch.ones(4))
    _BackgroundCopy([(torch.zeros(4), torch.ones(5))], copied, 2).wait()
    with pytest.raises(RuntimeError, match="staging buffers failed"):
        _wait_for_copy(copied, 2)
    _BackgroundCopy([(buffer, torch.full((4,), 2.0))], copied, 3).wait()
    _wait_for_copy(copied, 3)


def test_a_sync_save_heartbeats_as_it_writes_and_hashes(one_rank: None, tmp_path: Path) -> None:
    """A sync save runs in the loop, seconds for a large state: ``heartbeat`` is called after each
    write into the shard and each chunk hashed, and the shard is DCP's own (it loads back)."""
    made: list[bool] = []  # per call: whether DCP's save was complete (then it is the hashing's)
    tensors = {"model": {f"w{i}": torch.full((1024,), float(i)) for i in range(4)}}
    (tmp_path / "rank0.pt").write_bytes(b"rank state")  # what the Checkpointer writes first
    SyncDcpWriter().start(
        tensors, tmp_path, new_group(), SaveHooks(heartbeat=lambda: made.append((tmp_path / ".metadata").exists()))
    )
    assert len(made) >= len(tensors["model"]) + 2  # a write per tensor, a chunk per file hashed
    assert made.count(True) == 3  # the shard, the rank state and the digest record: one chunk each
    loaded = {"model": {name: torch.zeros(1024) for name in tensors["model"]}}
    dcp.load(loaded, checkpoint_id=tmp_path)
    assert all(torch.equal(loaded["model"][n], t) for n, t in tensors["model"].items())
    record = json.loads((tmp_path / "checksums_rank0.json").read_text())
    assert {name: entry["sha256"] for name, entry in record.items()} == {
        name: file_sha256(tmp_path / name) for name in record
    }


def test_with_a_signing_key_only_signed_checkpoints_load(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone who can write the checkpoint's storage replaces a shard and rewrites its checksum in
    the manifest: checksums alone cannot tell; the signature can."""
    monkeypatch.setenv(SIGNING_KEY_ENV, "the run's secret")
    run_steps(checkpointer(tmp_path, FakeWriter()), last=6)
    newest = latest_checkpoint(tmp_path)
    verify_checkpoint(newest)
    manifest = json.loads((newest / MANIFEST).read_text())
    assert len(manifest["signature"]) == 64
    (newest / "__0_0.distcp").write_bytes(b"someone else's tensors")
    manifest["files"]["__0_0.distcp"] = {"size": 22, "sha256": file_sha256(newest / "__0_0.distcp")}
    (newest / MANIFEST).write_text(json.dumps(manifest))

    with pytest.raises(CheckpointError, match="signature that does not match"):
        verify_checkpoint(newest)
    loaded: list[Path] = []
    assert checkpointer(tmp_path, FakeWriter()).load_latest(loaded.append) == 3  # the altered one is skipped
    skipped, repaired = select(read_events(tmp_path), RunWarning)
    assert (skipped.kind, skipped.step, repaired.kind) == ("checkpoint_skipped", 6, "latest_repaired")
    aside = newest.with_name(f"{newest.name}.rejected")
    assert aside.is_dir() and not newest.exists(), "the rejected one is set aside"
    aside.rename(newest)

    monkeypatch.setenv(SIGNING_KEY_ENV, "another key")
    with pytest.raises(CheckpointError, match="signature that does not match"):
        verify_checkpoint(tmp_path / CHECKPOINTS / step_dir_name(3))
    monkeypatch.delenv(SIGNING_KEY_ENV)
    verify_checkpoint(newest)  # without a key, checksums are all there is: the altered one passes
    unsigned = tmp_path / "unsigned"
    run_steps(checkpointer(unsigned, FakeWriter()), last=3)
    monkeypatch.setenv(SIGNING_KEY_ENV, "the run's secret")
    with pytest.raises(CheckpointError, match="is not signed"):
        verify_checkpoint(latest_checkpoint(unsigned))


def test_resume_offers_its_checkpoint_to_the_mirror_once(one_rank: None, tmp_path: Path) -> None:
    """Rank 0 died after publishing step 6 but before its upload: the resume uploads it; a
    resume from a checkpoint the remote already has uploads nothing again."""
    run, remote = tmp_path / "run", tmp_path / "remote"
    mirror = CheckpointMirror(str(remote), run, keep_last=2)
    run_steps(checkpointer(run, FakeWriter(), on_published=mirror.submit), last=3)
    assert mirror.close()
    run_steps(checkpointer(run, FakeWriter(), keep_last=3), last=6)  # steps 4-6 again, step 6 never mirrored
    assert (remote / CHECKPOINTS / "latest").read_text() == step_dir_name(3) + "\n"

    def resume() -> int:
        """Resume with the mirror on; returns the remote step-6 shard's mtime."""
        mirror = CheckpointMirror(str(remote), run, keep_last=2)
        assert checkpointer(run, FakeWriter(), on_published=mirror.submit).load_latest(lambda path: None) == 6
        assert mirror.close()
        assert (remote / CHECKPOINTS / "latest").read_text() == step_dir_name(6) + "\n"
        verify_checkpoint(remote / CHECKPOINTS / step_dir_name(6))
        return (remote / CHECKPOINTS / step_dir_name(6) / "__0_0.distcp").stat().st_mtime_ns

    assert resume() == resume()  # the second resume found it there and uploaded nothing


def test_retention_counts_only_what_resume_accepts(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a signing-key rotation, a run whose every checkpoint fails its signature is refused
    (it would start over on top of them, and its mirror's); nothing is set aside. With another key
    for the old ones and a rerun with another config, resume rejects the older run's
    checkpoints, which are newer than anything of the new one. Before, retention counted them and
    deleted the new run's newest checkpoints as they were published; now they are set aside
    (``step_N.rejected``, kept) and the new run keeps its own newest ``keep_last``."""
    monkeypatch.setenv(SIGNING_KEY_ENV, "the old key")
    run_steps(checkpointer(tmp_path, FakeWriter()), last=30)
    assert [s for s, _ in published_checkpoints(tmp_path / CHECKPOINTS)] == [27, 30]
    monkeypatch.setenv(SIGNING_KEY_ENV, "the new key")
    with pytest.raises(
        UnsignedResumeError, match="no checkpoint of this run could be verified .* the key they were signed with"
    ):
        checkpointer(tmp_path, FakeWriter()).find_latest()
    assert [s for s, _ in published_checkpoints(tmp_path / CHECKPOINTS)] == [27, 30]  # nothing set aside
    run_steps(checkpointer(tmp_path / "new", FakeWriter()), last=1)  # one checkpoint the new key verifies
    for step in (27, 30):
        shutil.copytree(
            tmp_path / CHECKPOINTS / step_dir_name(step), tmp_path / "new" / CHECKPOINTS / step_dir_name(step)
        )
    tmp_path = tmp_path / "new"
    ckpt = checkpointer(tmp_path, FakeWriter())
    assert ckpt.find_latest() == 1
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS).glob("*.rejected")) == [
        "step_000027.rejected",
        "step_000030.rejected",
    ]
    run_steps(ckpt, last=7)
    assert [s for s, _ in published_checkpoints(tmp_path / CHECKPOINTS)] == [6, 7]
    assert latest_checkpoint(tmp_path).name == step_dir_name(7)
    verify_checkpoint(latest_checkpoint(tmp_path))

    rerun = Checkpointer(
        tmp_path,
        writer=FakeWriter(),
        group=new_group(),
        events=EventLog(tmp_path, 0),
        fingerprint="g",
        every=3,
        keep_last=2,
    )
    assert rerun.find_latest() == 0  # another config's checkpoints
    run_steps(rerun, last=4)
    assert [s for s, _ in published_checkpoints(tmp_path / CHECKPOINTS)] == [3, 4]
    assert len(list((tmp_path / CHECKPOINTS).glob("step_*.rejected*"))) == 4  # kept, none counted


def test_retention_never_deletes_latest_nor_anything_newer(one_rank: None, tmp_path: Path) -> None:
    """A checkpoint newer than the one just published (this run never checked it) and the one
    ``latest`` names stay, whatever ``keep_last`` says."""
    run_steps(checkpointer(tmp_path, FakeWriter(), keep_last=1), last=3)
    shutil.copytree(tmp_path / CHECKPOINTS / step_dir_name(3), tmp_path / CHECKPOINTS / step_dir_name(50))
    ckpt = checkpointer(tmp_path, FakeWriter(), keep_last=1)
    ckpt.save(6, lambda: state(6))
    ckpt.finish()
    assert [s for s, _ in published_checkpoints(tmp_path / CHECKPOINTS)] == [6, 50]
    run_steps(checkpointer(tmp_path / "b", FakeWriter(), keep_last=1), last=6)
    (tmp_path / "b" / CHECKPOINTS / "latest").write_text(step_dir_name(3) + "\n")
    shutil.copytree(tmp_path / CHECKPOINTS / step_dir_name(6), tmp_path / "b" / CHECKPOINTS / step_dir_name(3))
    checkpointer(tmp_path / "b", FakeWriter(), keep_last=1)._retain(6)  # latest names step 3: it stays
    assert [s for s, _ in published_checkpoints(tmp_path / "b" / CHECKPOINTS)] == [3, 6]


def test_every_staging_buffer_is_in_shared_memory_before_any_write() -> None:
    """The async writer's staging buffers are shared memory from the start, AdamW's 0-dim step
    counts too (torch's helper leaves those private). A private one was moved into shared memory
    only when the write was handed to the worker, while the copy beside the next step could be
    writing it: under load a write in between was lost and the checkpoint kept a step count of 0,
    so a resume from it updated with the wrong bias correction (an exact-resume test saw it)."""
    from trainer.rank.resilience import _shared_buffers_like

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    staging = _shared_buffers_like(
        {"model": model.state_dict(), "optim": optimizer.state_dict()["state"]}, lambda: None
    )

    def tensors(tree: object) -> list[torch.Tensor]:
        return [t for v in tree.values() for t in tensors(v)] if isinstance(tree, dict) else [tree]

    assert any(t.dim() == 0 for t in tensors(staging))  # the step counts are there
    assert [t.is_shared() for t in tensors(staging)] == [True] * len(tensors(staging))


def test_a_checkpoint_that_cannot_be_read_is_left_in_place(one_rank: None, tmp_path: Path) -> None:
    """A read error (here the manifest is a folder: EISDIR; on a cluster a stale NFS handle or
    EIO) may pass: the checkpoint is skipped but not set aside, and a run with nothing else to
    resume from is refused instead of starting over on top of it."""
    run_steps(checkpointer(tmp_path, FakeWriter(), keep_last=3), last=6)
    assert [s for s, _ in published_checkpoints(tmp_path / CHECKPOINTS)] == [3, 6]
    manifest = tmp_path / CHECKPOINTS / step_dir_name(6) / MANIFEST
    manifest.unlink()
    manifest.mkdir()
    assert checkpointer(tmp_path, FakeWriter()).find_latest() == 3
    assert [s for s, _ in published_checkpoints(tmp_path / CHECKPOINTS)] == [3, 6]  # step 6 stays where it is
    shutil.rmtree(tmp_path / CHECKPOINTS / step_dir_name(3))
    with pytest.raises(UnsignedResumeError, match="no checkpoint of this run could be verified"):
        checkpointer(tmp_path, FakeWriter()).find_latest()
