#!/usr/bin/env bash
# The feature walk-through as one end-to-end check, from a fresh clone (after `make install`):
#
#   LoRA train -> export (merged and peft adapter) -> load in transformers and peft; freeze + a
#   per-group LR (logged per group); packing; video; Qwen3-VL; the trackers (TensorBoard, W&B
#   offline, MLflow file store); a sweep; `dhp runs`; `dhp report`; `dhp plan --auto --save` ->
#   `dhp train` of the saved recipe; SIGTERM mid-run -> `train.resume=auto`.
#
# Usage: scripts/walkthrough.sh [WORK_DIR]   (default: a new temp dir; kept afterwards)
# Exits 0 when every step passed, else at the first failure with its step named. Not part of the
# test suite: it trains about a dozen tiny runs (on a quiet 2-core box, roughly 15 minutes).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
WORK="${1:-$(mktemp -d -t dhp-walkthrough-XXXXXX)}"
mkdir -p "$WORK"
RUNS="$WORK/runs"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
DHP="${DHP:-$ROOT/.venv/bin/dhp}"
export WANDB_MODE=offline WANDB_SILENT=true MLFLOW_ALLOW_FILE_STORE=true PYTHONUNBUFFERED=1
STEP=""
T0=$SECONDS

step() {
  STEP="$1"
  echo
  echo "=== [$((SECONDS - T0)) s] $STEP"
}
trap 'echo; echo "walkthrough FAILED at: ${STEP} (work dir ${WORK})"' ERR

newest() { ls -1d "$RUNS/$1"/*/ | sort | tail -1; }

step "a tiny Qwen2.5-VL checkpoint (config, safetensors, tokenizer, processor)"
"$PY" scripts/make_tiny_checkpoint.py --out "$WORK/tiny_qwen"

step "LoRA: train (vision SP=2 + LLM TP=2), export merged and as a peft adapter"
"$DHP" train conf=tiny_vlm_lora train.steps=2 "train.output_dir=$RUNS"
LORA_RUN="$(newest tiny_vlm_lora)"
"$DHP" export "$LORA_RUN" "$WORK/lora_merged"
"$DHP" export "$LORA_RUN" "$WORK/lora_adapter" --lora adapter --adapter-base ..

step "LoRA: the exports load in transformers and peft and give the same logits"
"$PY" - "$WORK" <<'EOF'
import sys
from pathlib import Path

import torch
from peft import PeftModel
from transformers import Qwen2_5_VLForConditionalGeneration as M

work = Path(sys.argv[1])
merged = M.from_pretrained(work / "lora_merged").eval()
base = M.from_pretrained(work / "lora_adapter").eval()
adapted = PeftModel.from_pretrained(base, work / "lora_adapter" / "adapter").eval()
ids = torch.randint(0, merged.config.text_config.vocab_size - 10, (1, 16))
with torch.no_grad():
    a, b = merged(input_ids=ids).logits, adapted(input_ids=ids).logits
assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
print(f"merged and peft adapter agree: max |diff| {(a - b).abs().max():.2e}")
EOF

step "freeze + per-group LR: frozen blocks, the LM head at 10x, each group's LR logged"
"$DHP" train conf=tiny_vlm train.steps=2 train.warmup_steps=0 name=freeze_groups "train.output_dir=$RUNS" \
  'modules.vision.freeze_patterns=["visual.blocks.0"]' \
  'modules.llm.param_groups=[{match: lm_head, lr: 1e-2}]' train.lr=1e-3
"$PY" - "$(newest freeze_groups)" <<'EOF'
import json
import sys
from pathlib import Path

rows = [json.loads(x) for x in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines() if x.strip()]
groups = rows[-1]["lr_groups"]
assert abs(groups["llm/lm_head"] / groups["llm/default"] - 10.0) < 1e-9, groups
print("lr_groups:", groups)
EOF

step "packing: packed rows vs every sample alone (verify)"
"$DHP" verify conf=tiny_vlm_packed --steps 2

step "video: against transformers' pixel_values_videos (verify)"
"$DHP" verify conf=tiny_vlm_video --steps 2

step "Qwen3-VL: train the tiny Qwen3-VL (DeepStack)"
"$DHP" train conf=tiny_qwen3_vl train.steps=2 "train.output_dir=$RUNS"

step "trackers: TensorBoard, W&B (offline), MLflow (file store), checked before Ray starts"
"$DHP" train conf=tiny_vlm train.steps=2 name=trackers "train.output_dir=$RUNS" \
  'metrics.loggers=[jsonl,tensorboard,wandb,mlflow]' metrics.wandb.mode=offline \
  "metrics.mlflow.tracking_uri=file:$WORK/mlruns"
TRACK_RUN="$(newest trackers)"
test -f "$TRACK_RUN/trackers.json" && ls -d "$TRACK_RUN"/tb "$TRACK_RUN"/wandb/offline-run-* >/dev/null

step "sweep: two learning rates, one run each, then the summary"
"$DHP" train conf=tiny_vlm -m train.lr=1e-3,2e-3 train.steps=2 name=sweep "train.output_dir=$RUNS"

step "runs and report"
"$DHP" runs "$RUNS"
"$DHP" report "$TRACK_RUN"
ls "$TRACK_RUN"/report/*.png >/dev/null

step "--auto --save -> train the saved recipe (its own run name)"
"$DHP" plan conf=tiny_vlm cluster.gpus_per_node=2 train.steps=2 train.warmup_steps=0 \
  "train.output_dir=$RUNS" --auto --dry-run --save "$WORK/auto.yaml"
grep -q '^name: tiny_vlm_auto$' "$WORK/auto.yaml"
"$DHP" train "conf=$WORK/auto.yaml"
test -f "$(newest tiny_vlm_auto)/metrics.jsonl"

step "SIGTERM mid-run saves a checkpoint (exit 143); train.resume=auto continues it"
"$DHP" train conf=tiny_vlm name=term train.steps=200 train.checkpoint_every=0 "train.output_dir=$RUNS" &
PID=$!
for _ in $(seq 1 600); do
  M="$(ls "$RUNS"/term/*/metrics.jsonl 2>/dev/null | head -1 || true)"
  if [ -n "$M" ] && [ "$(wc -l <"$M")" -ge 2 ]; then break; fi
  kill -0 "$PID" 2>/dev/null || { echo "the run ended before step 2"; exit 1; }
  sleep 1
done
kill -TERM "$PID"
RC=0
wait "$PID" || RC=$?  # (not a failing command: the ERR trap stays quiet)
[ "$RC" -eq 143 ] || { echo "SIGTERM gave exit $RC, not 143"; exit 1; }
DONE="$(ls -1d "$RUNS"/term/*/checkpoints/step_* | sort | tail -1)"
N=$((10#${DONE##*step_}))
echo "checkpoint at step $N"
"$DHP" train conf=tiny_vlm name=term train.resume=auto "train.steps=$((N + 2))" "train.output_dir=$RUNS"
"$DHP" runs "$RUNS"

echo
echo "walkthrough passed in $((SECONDS - T0)) s (work dir $WORK)"
