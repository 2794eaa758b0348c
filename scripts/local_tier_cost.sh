#!/usr/bin/env bash
# The local tier's cost, side by side: the same run without it and with a snapshot every step
# (--model small, 2 ranks, 40 steps, durable checkpoints every 10), ROUNDS rounds interleaved so
# that a change in the machine's load hits both alike. Prints per round the step interval (one
# `step` event to the next, p50, from step 5), the timed step (p50) and the stall per local
# snapshot (p50), with the machine's load before and after. Usage: scripts/local_tier_cost.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-work/local_tier_cost}}
RFSDP=${RFSDP:-.venv/bin/rfsdp}
PY=${PY:-.venv/bin/python}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
[ -d "$OUT/data" ] || $RFSDP prepare-data --out "$OUT/data" > /dev/null
for round in $(seq "$ROUNDS"); do
  for every in 0 1; do
    rm -rf "$OUT/every${every}_$round"
    echo "round $round, --local-ckpt-every $every: $(uptime)"
    $RFSDP train --quiet --data "$OUT/data" --run-dir "$OUT/every${every}_$round" --model small --steps 40 --ckpt-every 10 \
      --local-ckpt-every "$every" > /dev/null
  done
done
echo "end: $(uptime)"
$PY - "$OUT" "$ROUNDS" <<'PY'
import statistics, sys
from pathlib import Path
from trainer.events import Checkpoint, Step, read_events, select
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
for r in range(1, rounds + 1):
    figures = {}
    for every in (0, 1):
        events = read_events(out / f"every{every}_{r}")
        steps = select(events, Step)
        gaps = [b.time - a.time for a, b in zip(steps, steps[1:]) if a.step >= 5 and b.step == a.step + 1]
        stalls = [e.blocking_s for e in select(events, Checkpoint) if e.tier == "local"]
        figures[every] = (statistics.median(gaps), statistics.median(e.step_time_s for e in steps if e.step >= 5), stalls)
    (g0, t0, _), (g1, t1, stalls) = figures[0], figures[1]
    print(f"round {r}: step interval p50 {g1:.3f} vs {g0:.3f} s = {g1 / g0:.3f}x; timed step p50 {t1:.3f} vs {t0:.3f} s = "
          f"{t1 / t0:.3f}x; local stall p50 {statistics.median(stalls):.4f} s ({len(stalls)} snapshots)")
PY
