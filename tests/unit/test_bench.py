"""The soak benchmark's fault schedule and the CLI's refusals, in this process. `rfsdp bench`
itself (each benchmark's real jobs, `--quick`): tests/integration/test_bench_runs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import schedule
from tests.conftest import rfsdp_here
from trainer.rank.config import TrainConfig


def test_soak_schedule_cycles_kinds_and_ranks() -> None:
    steps, spec = schedule(interval=96, ckpt_every=8, faults=6)
    assert steps == 672
    assert spec == "exception@100:0,sigkill@196:1,hang@292:0,exception@388:1,sigkill@484:0,hang@580:1"
    cfg = TrainConfig(data="d", run_dir="r", steps=steps, ckpt_every=8, fault=spec)  # the trainer accepts it
    assert [(f.kind, f.step % 8) for f in cfg.faults] == [
        (k, 4) for k in ("exception", "sigkill", "hang") * 2
    ]  # mid-interval


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("soak", "--fault-every", "0.5"), "--fault-every: must be a number of seconds >= 1"),
        (("soak", "--fault-every", "nan"), "--fault-every: must be a number of seconds >= 1"),
        (("soak", "--fault-every", "soon"), "argument --fault-every: invalid float value"),
        (("goodput", "--fault-every", "30"), "--fault-every applies to the soak benchmark only"),
        (("soak", "--ckpts-per-fault", "0"), "--ckpts-per-fault: must be a whole number >= 1, got 0"),
        (("soak", "--ckpts-per-fault", "2.5"), "argument --ckpts-per-fault: invalid int value"),
        (("recovery", "--ckpts-per-fault", "2"), "--ckpts-per-fault applies to the soak benchmark only"),
        (("goodput", "--audit"), "--audit applies to the soak benchmark only"),
    ],
)
def test_bad_fault_every_is_refused(
    args: tuple[str, ...], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code, err = rfsdp_here(capsys, "bench", *args, "--work", str(tmp_path / "work"))
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "work").exists()  # refused before anything ran


def test_unknown_benchmark_is_refused(capsys: pytest.CaptureFixture) -> None:
    code, err = rfsdp_here(capsys, "bench", "nope")
    assert code == 2 and "invalid choice" in err and "Traceback" not in err


def test_unwritable_json_path_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, err = rfsdp_here(
        capsys, "bench", "overhead", "--quick", "--json", str(blocker / "out.json"), "--work", str(tmp_path / "work")
    )
    assert code == 2 and "--json" in err and "Traceback" not in err
    assert not (tmp_path / "work").exists()  # refused before anything was written


def test_model_is_refused_where_it_does_not_apply_or_is_bad(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = rfsdp_here(capsys, "bench", "soak", "--model", "tiny", "--work", str(tmp_path / "work"))
    assert code == 2 and "--model applies to the checkpoint and overhead" in err and "Traceback" not in err
    code, err = rfsdp_here(
        capsys, "bench", "checkpoint", "--model", f"hf:{tmp_path / 'missing'}", "--work", str(tmp_path / "work")
    )
    assert code == 2 and "--model" in err and "Traceback" not in err
    assert not (tmp_path / "work").exists()  # refused before anything ran


def test_the_crossover_is_the_smallest_state_then_the_shortest_interval_where_async_won() -> None:
    from bench.crossover import crossover

    def cell(model: str, every: int, size: int, ratio: float) -> dict:
        return {"model": model, "every": every, "bytes_per_rank": size, "async_over_sync": ratio}

    cells = [cell("tiny", 2, 1, 1.3), cell("small", 10, 20, 0.97), cell("small", 2, 20, 0.9), cell("base", 2, 500, 0.5)]
    assert crossover(cells) == cell("small", 2, 20, 0.9)
    assert crossover([cell("tiny", 2, 1, 1.0), cell("small", 2, 20, None)]) is None  # a tie is no win
