"""`rfsdp validate`: every check fails on its own fault; all pass on a good checkpoint of a real
2-rank run written asynchronously while training continued; bad input exits 2 with a clear message.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import rfsdp, train
from tests.unit.test_checkpoint_digests import redigest
from trainer import cli
from trainer.checkpoint import CHECKPOINTS, MANIFEST, read_full_state
from trainer.fsutil import file_sha256
from trainer.results.validate import CHECKS, validate_run


def copy_run(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def ckpt(run: Path, step: int) -> Path:
    return run / CHECKPOINTS / f"step_{step:06d}"


def reseal(path: Path) -> None:
    """Record the checkpoint's current files in its manifest, as if they had been saved so."""
    manifest = json.loads((path / MANIFEST).read_text())
    names = [p.name for p in path.iterdir() if p.name != MANIFEST and not p.name.startswith("checksums_rank")]
    manifest["files"] = {n: {"size": (path / n).stat().st_size, "sha256": file_sha256(path / n)} for n in names}
    (path / MANIFEST).write_text(json.dumps(manifest))


def by_name(report) -> dict:
    return {c.name: c for c in report.checks}


def test_good_latest_checkpoint_passes_every_check(baseline_60: Path, tmp_path: Path) -> None:
    before = sorted(str(p.relative_to(baseline_60)) for p in baseline_60.rglob("*"))
    table = tmp_path / "report.md"
    proc = rfsdp("validate", "--run-dir", str(baseline_60), "--markdown", str(table))
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = json.loads(proc.stdout)
    assert verdict["valid"] and verdict["step"] == 60 and verdict["failed"] == [] and verdict["skipped"] == []
    checks = {c["name"]: c for c in verdict["checks"]}
    assert list(checks) == list(CHECKS) and all(c["passed"] for c in checks.values())
    assert checks["complete"]["values"]["latest"] == "step_000060" and checks["complete"]["values"]["shards"] == 2
    assert (
        checks["loadable"]["values"]["reshard_world_size"] == 3
        and checks["loadable"]["values"]["reshard_mismatches"] == 0
    )
    assert checks["finite"]["values"]["nonfinite_tensors"] == 0 and checks["finite"]["values"]["param_norm"] > 0
    assert checks["quality"]["values"]["improvement"] >= 0.5
    # The run's last checkpoint: reproduced from step 50, losses and state bit for bit.
    replays = checks["replays"]["values"]
    assert (replays["mode"], replays["from_step"], replays["to_step"], replays["state_mismatches"]) == (
        "reproduce",
        50,
        60,
        0,
    )
    assert all(v["logged"] == v["replayed"] for v in replays["losses"].values()) and len(replays["losses"]) == 10
    assert "step_000060 is valid" in proc.stderr and "Traceback" not in proc.stderr
    md = table.read_text()
    assert "**valid**" in md and all(f"| {name} | pass |" in md for name in CHECKS)
    assert (
        sorted(str(p.relative_to(baseline_60)) for p in baseline_60.rglob("*")) == before
    )  # validation wrote nothing there


def test_removed_shard_fails_complete_tampered_position_fails_replays_and_fallback_finds_a_valid_one(
    baseline_60: Path, tmp_path: Path
) -> None:
    run = copy_run(baseline_60, tmp_path)
    (ckpt(run, 60) / "__1_0.distcp").unlink()
    report = validate_run(run)
    assert not report.valid and report.failed == ["complete"] and report.skipped == list(CHECKS[1:])
    assert "missing __1_0.distcp" in by_name(report)["complete"].detail

    rank0 = ckpt(run, 50) / "rank0.pt"
    state = torch.load(rank0, weights_only=False)
    state["loader"]["position"] += 16  # one step further into the data
    torch.save(state, rank0)
    reseal(ckpt(run, 50))

    report = validate_run(run, fallback=True)
    assert report.valid and report.step == 40 and report.failed == []
    assert [(r["step"], r["failed"]) for r in report.rejected] == [(60, ["complete"]), (50, ["replays"])]
    assert "step 51 replayed to loss" in report.rejected[1]["detail"]
    replays = by_name(report)["replays"].values
    assert (replays["mode"], replays["from_step"], replays["to_step"], replays["mismatched_steps"]) == (
        "resume",
        40,
        43,
        0,
    )
    assert report.metrics()["valid"] == 1.0 and report.metrics()["step"] == 40.0
    assert "`step_000050` rejected first: replays failed" in report.to_markdown()


def test_flipped_byte_fails_intact(baseline_60: Path, tmp_path: Path) -> None:
    run = copy_run(baseline_60, tmp_path)
    shard = ckpt(run, 60) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    report = validate_run(run)
    checks = by_name(report)
    assert not report.valid and report.failed == ["intact"] and checks["complete"].passed
    assert checks["intact"].detail == "step_000060: __0_0.distcp fails its checksum"
    assert report.skipped == ["loadable", "finite", "quality", "replays"]


def test_nan_in_optimizer_state_fails_finite_only(baseline_60: Path, tmp_path: Path) -> None:
    run = copy_run(baseline_60, tmp_path)
    path = ckpt(run, 60)
    state = read_full_state(path)
    state["optim"]["state"]["blocks.0.up.weight"]["exp_avg"][3, 5] = float("nan")
    for old in [*path.glob("__*_0.distcp"), path / ".metadata"]:
        old.unlink()
    dcp.save(state, checkpoint_id=path)  # a valid DCP checkpoint again (one shard), so only the NaN is wrong
    reseal(path)
    redigest(path)  # the ranks' digests of what they saved, made to say they saved the NaN
    reseal(path)
    report = validate_run(run)
    checks = by_name(report)
    assert report.failed == ["finite"] and report.skipped == ["replays"]
    assert (
        checks["complete"].passed and checks["intact"].passed and checks["loadable"].passed and checks["quality"].passed
    )
    assert checks["finite"].values["nonfinite"] == ["optim.state.blocks.0.up.weight.exp_avg"]
    assert checks["loadable"].values["reshard_mismatches"] == 0  # the NaN survives resharding bit for bit
    verdict = json.dumps(report.to_dict(), allow_nan=False)  # standard JSON even with NaN around
    assert json.loads(verdict)["failed"] == ["finite"]


def test_untrained_checkpoint_fails_quality(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "untrained"
    train(
        data_dir,
        run,
        "--steps",
        "60",
        "--stop-at-step",
        "1",
        "--ckpt-every",
        "1",
        "--ckpt-mode",
        "sync",
        "--no-inprocess-restart",
    )
    report = validate_run(run)
    checks = by_name(report)
    assert not report.valid and report.failed == ["quality"] and report.step == 1
    assert checks["quality"].values["improvement"] < 0.5 and "less than 0.5 lower" in checks["quality"].detail
    assert (
        checks["complete"].passed and checks["intact"].passed and checks["loadable"].passed and checks["finite"].passed
    )
    assert report.skipped == ["replays"]  # the training job is spent only on an otherwise accepted checkpoint
    assert report.summary().startswith("step_000001 is invalid: quality failed")


def test_bad_input_exits_2_with_a_clear_message(baseline_60: Path, data_dir: Path, tmp_path: Path, capsys) -> None:
    def refused(*args: str) -> str:
        assert cli.main(["validate", *args]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("rfsdp validate: error: ") and "Traceback" not in err
        return err

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((baseline_60 / "config.json").read_text())
    assert "has no published checkpoint" in refused("--run-dir", str(empty), "--data", str(data_dir))
    assert "does not exist" in refused("--run-dir", str(tmp_path / "nowhere"))
    assert "--step 7: " in refused("--run-dir", str(baseline_60), "--step", "7")
    assert "--replay-steps must be at least 1" in refused("--run-dir", str(baseline_60), "--replay-steps", "0")
    assert "--markdown: directory" in refused(
        "--run-dir", str(baseline_60), "--markdown", str(tmp_path / "no" / "report.md")
    )

    other = copy_run(baseline_60, tmp_path)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model": "small"}))
    assert "written by another training config" in refused("--run-dir", str(other))

    assert "no manifest.json" in refused("--run-dir", str(baseline_60), "--data", str(empty))
    corrupt = Path(shutil.copytree(data_dir, tmp_path / "data"))
    val = corrupt / "val_000.bin"
    val.write_bytes(b"\x00\x01" + val.read_bytes()[2:])
    assert "fails its checksum" in refused("--run-dir", str(baseline_60), "--data", str(corrupt))

    # The same through the installed command: exit 2, one line, no traceback.
    proc = rfsdp("validate", "--run-dir", str(empty), "--data", str(data_dir))
    assert (
        proc.returncode == 2
        and proc.stdout == ""
        and "Traceback" not in proc.stderr
        and "no published checkpoint" in proc.stderr
    )
