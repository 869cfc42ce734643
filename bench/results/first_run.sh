#!/usr/bin/env bash
# `make run`'s training as a results record: `flexmarl train configs/default.yaml` on a clean
# export of a commit (see record.sh), piped as a scheduler would run it.
#
#   bash bench/results/first_run.sh [COMMIT]
#
# Writes bench/results/first-run.log (what the terminal showed), bench/results/first-run.json
# (the run's metrics/iterations.jsonl rows) and bench/results/first-run.provenance.json.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
sha=$(git -C "$repo" rev-parse "${1:-HEAD}")
tree=${FLEXMARL_BENCH_TREE:-/tmp/flexmarl-bench}/${sha:0:12}
if [[ ! -d $tree ]]; then
    mkdir -p "$tree"
    git -C "$repo" archive "$sha" | tar -x -C "$tree"
fi
out=$repo/bench/results
py=$repo/.venv/bin/python
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start=$(date -u +%Y-%m-%dT%H:%M:%SZ)
t0=$(date +%s)
rc=0
(cd "$tree" && rm -rf runs/arith-team && PYTHONPATH=$tree PREFECT_HOME=$tree/.prefect \
    FLEXMARL_CACHE=$tree/.cache PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 \
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} nice -n 5 "$py" -m flexmarl.cli train configs/default.yaml) > "$out/first-run.log" 2>&1 || rc=$?
t1=$(date +%s)
end=$(date -u +%Y-%m-%dT%H:%M:%SZ)
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
"$py" - "$tree/runs/arith-team/metrics/iterations.jsonl" "$out" <<EOF
import json, os, platform, sys
import torch
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
json.dump({"config": "configs/default.yaml", "iterations": rows}, open(f"{sys.argv[2]}/first-run.json", "w"))
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
mem = int(open("/proc/meminfo").readline().split()[1]) / 2**20
json.dump({
    "command": "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} nice -n 5 .venv/bin/flexmarl train configs/default.yaml > bench/results/first-run.log",
    "commit": "$sha",
    "start_utc": "$start", "end_utc": "$end", "wall_s": $((t1 - t0)), "exit_code": $rc,
    "load_before": "$load_before", "load_after": "$load_after",
    "machine": {"cpus": os.cpu_count(), "cpu": cpu, "memory_gib": round(mem, 1), "gpu": None,
                "python": platform.python_version(), "torch": torch.__version__},
}, open(f"{sys.argv[2]}/first-run.provenance.json", "w"), indent=1)
EOF
echo "first-run: exit $rc, $((t1 - t0)) s, load $load_before -> $load_after"
exit $rc
