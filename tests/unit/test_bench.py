"""The soak benchmark's fault schedule, in this process. `rfsdp bench` itself (each benchmark's real
jobs, `--quick`, and the CLI's refusals): tests/integration/test_bench_runs.py.
"""

from __future__ import annotations

from bench.soak import schedule
from trainer.rank.config import TrainConfig


def test_soak_schedule_cycles_kinds_and_ranks() -> None:
    steps, spec = schedule(interval=96, ckpt_every=8, faults=6)
    assert steps == 672
    assert spec == "exception@100:0,sigkill@196:1,hang@292:0,exception@388:1,sigkill@484:0,hang@580:1"
    cfg = TrainConfig(data="d", run_dir="r", steps=steps, ckpt_every=8, fault=spec)  # the trainer accepts it
    assert [(f.kind, f.step % 8) for f in cfg.faults] == [(k, 4) for k in ("exception", "sigkill", "hang") * 2]  # mid-interval
