#!/usr/bin/env bash
# GPU check (NCCL + bf16 + NVRx's CUDA async-checkpoint path + one fault of each recovery layer).
# Sized for one GPU in under 5 minutes. Usage: scripts/gpu_check.sh [OUT_DIR]
# Prints a JSON line of figures at the end and exits non-zero if any check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-work/gpu_check}}
RFSDP=${RFSDP:-.venv/bin/rfsdp}
PY=${PY:-.venv/bin/python}
NPROC=$($PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.device_count())")
MODEL=${MODEL:-base}
STEPS=60
rm -rf "$OUT" && mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$RFSDP prepare-data --out "$OUT/data"
common=(--data "$OUT/data" --model "$MODEL" --steps $STEPS --ckpt-every 10 --nproc-per-node "$NPROC" --quiet)
echo "== baseline: async checkpoints, no faults"
$RFSDP train "${common[@]}" --run-dir "$OUT/baseline"
echo "== sync checkpoints (stall baseline)"
$RFSDP train "${common[@]}" --run-dir "$OUT/sync" --ckpt-mode sync
echo "== exception (in-process restart) then SIGKILL (in-job restart)"
$RFSDP train "${common[@]}" --run-dir "$OUT/faults" --fault exception@15:0,sigkill@35:0
$PY - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
from trainer.events import Checkpoint, Restart, Step, final_losses, read_events, select
out = Path(sys.argv[1])
ev = {name: read_events(out / name) for name in ("baseline", "sync", "faults")}
stall = {n: statistics.median(e.blocking_s for e in select(ev[n], Checkpoint)) for n in ("baseline", "sync")}
restarts = [(e.layer, round(e.recovery_s, 2), {k: round(v, 2) for k, v in (e.phases or {}).items()}) for e in select(ev["faults"], Restart)]
same = final_losses(ev["faults"]) == final_losses(ev["baseline"])
steps = [e.step_time_s for e in select(ev["baseline"], Step)]
report = {"async_median_blocking_s": stall["baseline"], "sync_median_blocking_s": stall["sync"],
          "stall_ratio": stall["baseline"] / stall["sync"], "restarts": restarts,
          "trajectory_identical_after_faults": same, "median_step_s": statistics.median(steps)}
print(json.dumps(report))
assert [layer for layer, _, _ in restarts] == ["in_process", "in_job"], restarts
PY
