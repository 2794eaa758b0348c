#!/usr/bin/env bash
# GPU check (NCCL + bf16 + NVRx's CUDA async-checkpoint path + one fault of each recovery layer and a hang,
# then a Llama-style Hugging Face model from its weights in bf16 with a fault).
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
echo "== exception (in-process restart), SIGKILL (in-job restart), then a hang (the step watch, in-job restart)"
$RFSDP train "${common[@]}" --run-dir "$OUT/faults" --fault exception@15:0,sigkill@35:0,hang@50:$((NPROC > 1 ? 1 : 0))
echo "== a Llama-style HF model (~100M) from saved weights, bf16, a SIGKILL, exported"
$PY -c "
import sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
c = LlamaConfig(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                num_key_value_heads=4, max_position_embeddings=1024)
torch.manual_seed(0); AutoModelForCausalLM.from_config(c).save_pretrained(sys.argv[1])" "$OUT/llama"
hf=(--data "$OUT/data" --model "hf:$OUT/llama" --seq-len 512 --steps 30 --ckpt-every 10 --nproc-per-node "$NPROC" --quiet)
$RFSDP train "${hf[@]}" --run-dir "$OUT/hf_baseline"
$RFSDP train "${hf[@]}" --run-dir "$OUT/hf_faults" --fault sigkill@15:0 --activation-checkpointing
$RFSDP validate --run-dir "$OUT/hf_faults" > "$OUT/hf_validate.json" || true  # the assert below says it
$PY - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
from trainer.events import Checkpoint, Restart, Step, final_losses, read_events, select
out = Path(sys.argv[1])
ev = {name: read_events(out / name) for name in ("baseline", "sync", "faults", "hf_baseline", "hf_faults")}
stall = {n: statistics.median(e.blocking_s for e in select(ev[n], Checkpoint)) for n in ("baseline", "sync")}
restarts = [(e.layer, round(e.recovery_s, 2), {k: round(v, 2) for k, v in (e.phases or {}).items()}) for e in select(ev["faults"], Restart)]
same = final_losses(ev["faults"]) == final_losses(ev["baseline"])
steps = [e.step_time_s for e in select(ev["baseline"], Step)]
report = {"async_median_blocking_s": stall["baseline"], "sync_median_blocking_s": stall["sync"],
          "stall_ratio": stall["baseline"] / stall["sync"], "restarts": restarts,
          "trajectory_identical_after_faults": same, "hang_recovery_s": restarts[-1][1] if len(restarts) == 3 else None, "median_step_s": statistics.median(steps),
          "hf_median_step_s": statistics.median(e.step_time_s for e in select(ev["hf_baseline"], Step)),
          "hf_restarts": [e.layer for e in select(ev["hf_faults"], Restart)],
          "hf_max_loss_diff_after_fault": max(abs(a - b) for a, b in zip(final_losses(ev["hf_faults"]).values(), final_losses(ev["hf_baseline"]).values())),
          "hf_valid": json.loads((out / "hf_validate.json").read_text())["valid"]}
print(json.dumps(report))
assert [layer for layer, _, _ in restarts] == ["in_process", "in_job", "in_job"], restarts
assert report["hf_restarts"] == ["in_job"] and report["hf_valid"], report
PY
