#!/usr/bin/env bash
# gpu_check.sh: the one prepared check of dhp on a single-GPU machine (one H200), run from a copy
# of the working tree there. Each check runs in its own process under its own timeout
# (scripts/gpu/checks.py CHECK, which runs scripts/gpu/check_<name>.py); one failing does not stop
# the others, the whole run ends within ~7.5 min; the exit status is non-zero if any check failed.
#   env    torch/CUDA/GPU, packages, bf16 8192^3 matmul TFLOP/s
#   flash  is flash_attn importable; else dhp must refuse flash_attention_2 (no silent fallback)
#   deltanet  the Gated DeltaNet kernel dhp names (fla-chunk or a torch fallback, which fails here),
#          flash-linear-attention's chunked delta rule + causal-conv1d vs transformers' torch
#          reference (output, state, input grads; fp32), and fwd+bwd ms of each on the GPU
#   grouped  EP's grouped-GEMM expert path (torch._grouped_mm, bf16) vs the per-expert loop, forward
#          and backward, with empty experts (their weight gradients must be exactly zero)
#   bf16   tiny and 7B-width (2 layers) VisionModule+LLMModule fwd/bwd, bf16 vs fp32 on the GPU
#   ipc    2 processes on one GPU: image embeddings through dhp's CudaIpcTransport vs a host copy;
#          a hand-off packed while the GPU still writes is ordered by the interprocess event alone
#   nccl   NCCL world of 1 through dhp.parallel (TP, Ulysses SP, DP all-reduce, ZeRO-1), and an
#          honest 2-rank NCCL attempt on the one GPU (NCCL normally refuses a duplicate GPU)
#   mfu    one training step (fwd+bwd+AdamW) of the 7B-width encoder + 8-layer LLM, 4096 patches,
#          bf16, sdpa: tokens/s and MFU by dhp.metrics against conf/cluster/h200_1x peak
#   train  `dhp plan` of a 1-GPU recipe; `dhp train` only where Ray is importable (too big for .whl/),
#          with the planner's predicted step time beside the measured median
# Results: $OUT/gpu_check.json (all checks) and $OUT/gpu_check.log (OUT unset: runs/gpu_check).
# Usage:
#   bash scripts/gpu_check.sh          # on the GPU machine (installs .whl/*.whl first if present)
#   bash scripts/gpu_check.sh --cpu    # dry run of the same logic on a CPU box (tiny sizes, ~1-2 min)
# It is meant to be run on the GPU machine after `bash scripts/gpu_wheels.sh` has fetched the missing
# pure-python wheels into .whl/ (copy .whl/ along with the tree); allow it ~9 min in all.
# Env: GPU_CHECK_MFU_ARGS (e.g. "--llm-layers 4"), GPU_CHECK_DEADLINE_S (default 450; cpu 170).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
MODE=gpu
CPUFLAG=()
for a in "$@"; do
  case "$a" in
    --cpu) MODE=cpu; CPUFLAG=(--cpu) ;;
    -h | --help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "unknown argument: $a (use --cpu or nothing)" >&2; exit 2 ;;
  esac
done

OUTDIR="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
: >"$LOG"
PARTS="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
START=$SECONDS
if [[ $MODE == cpu ]]; then DEADLINE=${GPU_CHECK_DEADLINE_S:-170}; else DEADLINE=${GPU_CHECK_DEADLINE_S:-450}; fi
PY=python3
[[ $MODE == cpu && -x .venv/bin/python ]] && PY=.venv/bin/python

log() { echo "$*" | tee -a "$LOG"; }

# Wheels carried in .whl/ (hydra-core, omegaconf, antlr4: see scripts/gpu_wheels.sh).
if [[ $MODE == gpu ]] && compgen -G ".whl/*.whl" >/dev/null; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$LOG" 2>&1; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    log "installed $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
  else
    log "WARNING: installing .whl/*.whl failed (see log); checks that need hydra/omegaconf will fail"
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
log "== gpu_check ($MODE) $(date -u +%FT%TZ) python=$($PY -c 'import sys; print(sys.version.split()[0])') out=$OUTDIR"

# run_check NAME LIMIT_S [extra args]: bounded by its own limit and by the global deadline.
run_check() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - (SECONDS - START) - 15))
  if ((left < 20)); then
    echo skip >"$PARTS/$name.rc"
    log "== $name: skipped: global deadline"
    return
  fi
  ((limit > left)) && limit=$left
  timeout -k 10 "$limit" "$PY" -W ignore::FutureWarning scripts/gpu/checks.py "$name" \
    --out "$PARTS/$name.json" "${CPUFLAG[@]}" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "$rc" >"$PARTS/$name.rc"
  ((rc == 124 || rc == 137)) && log "== $name: TIMED OUT after ${limit}s"
}

ORDER=env,flash,deltanet,grouped,bf16,ipc,nccl,mfu,train
run_check env 60
run_check flash 45
run_check deltanet 45
run_check grouped 45
run_check bf16 90
run_check ipc 75
run_check nccl 90 --nccl2-timeout 40
# shellcheck disable=SC2086  # word splitting of the extra args is intended
run_check mfu 150 ${GPU_CHECK_MFU_ARGS:-}
run_check train 150 --train-timeout 120

"$PY" scripts/gpu/summary.py "$PARTS" --out "$OUTDIR/gpu_check.json" --order "$ORDER" --mode "$MODE" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
# the measured step(s) as a calibration file `dhp plan cluster=...` can use (docs/CLUSTER.md section 7)
# (the train check's runs live under $PARTS/train_runs, removed below)
mapfile -t RUNDIRS < <(find "$PARTS" -name metrics.jsonl -printf '%h\n' 2>/dev/null)
if [ "${#RUNDIRS[@]}" -gt 0 ]; then
  "$PY" -m dhp.cli calibrate "${RUNDIRS[@]}" --out "$OUTDIR/calibrated_cluster.yaml" 2>&1 | tee -a "$LOG"
else
  log "no run with metrics.jsonl (the train check did not train): no calibration file written"
fi
log "total $((SECONDS - START)) s; results in $OUTDIR/gpu_check.json"
rm -rf "$PARTS"
exit "$rc"
