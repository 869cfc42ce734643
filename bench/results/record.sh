#!/usr/bin/env bash
# Run one benchmark for a results page: on a clean export of a commit (no uncommitted edits can
# leak into the figure), at nice 5, with the machine's load recorded before and after.
#
#   bash bench/results/record.sh NAME [COMMIT] -- bench/e2e.py --quick --repeats 2
#
# Writes bench/results/NAME.json (the bench's own --json) and bench/results/NAME.provenance.json
# (command, commit, start and end time, wall seconds, exit code, load before and after, machine).
set -euo pipefail
name=$1; shift
commit=HEAD
if [[ $1 != "--" ]]; then commit=$1; shift; fi
[[ $1 == "--" ]] || { echo "usage: record.sh NAME [COMMIT] -- BENCH_SCRIPT ARGS..." >&2; exit 2; }
shift
repo=$(cd "$(dirname "$0")/../.." && pwd)
sha=$(git -C "$repo" rev-parse "$commit")
tree=${FLEXMARL_BENCH_TREE:-/tmp/flexmarl-bench}/${sha:0:12}
if [[ ! -d $tree ]]; then
    mkdir -p "$tree"
    git -C "$repo" archive "$sha" | tar -x -C "$tree"
fi
out=$repo/bench/results
mkdir -p "$out"
py=$repo/.venv/bin/python
cmd=(nice -n 5 "$py" "$@" --json "$out/$name.json")
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start=$(date -u +%Y-%m-%dT%H:%M:%SZ)
t0=$(date +%s)
rc=0
# PYTHONPATH puts the export ahead of the venv's editable install, in this process and in every
# Dask worker it starts; a Prefect home and cache of its own keep the checkout's state out.
(cd "$tree" && PYTHONPATH=$tree PREFECT_HOME=$tree/.prefect FLEXMARL_CACHE=$tree/.cache \
    PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
    "${cmd[@]}") || rc=$?
t1=$(date +%s)
end=$(date -u +%Y-%m-%dT%H:%M:%SZ)
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
"$py" - "$out/$name.provenance.json" <<EOF
import json, os, platform, sys
import torch
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
mem = int(open("/proc/meminfo").readline().split()[1]) / 2**20
json.dump({
    "command": "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} nice -n 5 .venv/bin/python $* --json bench/results/$name.json",
    "commit": "$sha",
    "start_utc": "$start", "end_utc": "$end", "wall_s": $((t1 - t0)), "exit_code": $rc,
    "load_before": "$load_before", "load_after": "$load_after",
    "machine": {"cpus": os.cpu_count(), "cpu": cpu, "memory_gib": round(mem, 1), "gpu": None,
                "python": platform.python_version(), "torch": torch.__version__},
}, open(sys.argv[1], "w"), indent=1)
EOF
echo "$name: exit $rc, $((t1 - t0)) s, load $load_before -> $load_after"
exit $rc
