#!/usr/bin/env bash
# GPU check (bench/gpu_check.py: what it checks) with whatever Python the machine has: .venv's if
# there is one, else python3 (the lent GPU machine's own, with its CUDA torch). Packages that
# Python lacks come only from wheels carried in .whl/, installed into a scratch folder; nothing is
# fetched on the machine.
#
#   bash bench/gpu_check.sh --json runs/gpu_check.json [--quick]   # the check, on a CUDA GPU
#   bash bench/gpu_check.sh --dry-run --json /tmp/gpu.json          # the same script on the CPU
#   bash bench/gpu_check.sh --fetch-wheels [core|team]              # here: the wheels into .whl/
#
# --fetch-wheels: core (pydantic, every check needs it) or team (core + Prefect and Dask for the
# team run; the default), from bench/gpu_wheels.txt for CPython 3.12 on x86-64 Linux. It stops if
# they and the working tree would exceed the 64 MiB a device run carries. Add /.whl/ to
# .git/info/exclude and name .whl in the run's carry.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--fetch-wheels" ]; then
    part=${2:-team}
    case $part in
        core) reqs=$(sed -n '/^# core:/,/^# team:/p' bench/gpu_wheels.txt | grep -v '^#') ;;
        team) reqs=$(grep -v '^#' bench/gpu_wheels.txt) ;;
        *) echo "gpu_check: --fetch-wheels core|team, not '$part'" >&2; exit 2 ;;
    esac
    pip=(python3 -m pip)
    [ -x .venv/bin/python ] && pip=(.venv/bin/python -m pip)
    rm -rf .whl && mkdir .whl
    plats=()
    for p in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
        plats+=(--platform "${p}_x86_64")
    done
    # shellcheck disable=SC2086  # one requirement per word
    "${pip[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plats[@]}" -d .whl $reqs
    wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
    tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    limit=$((64 * 1024 * 1024))
    awk -v n="$(ls .whl | wc -l)" -v w="$wheels" -v t="$tree" 'BEGIN { printf "gpu_check: %d wheels, %.1f MiB; working tree %.1f MiB; a device run carries 64 MiB\n", n, w / 2^20, t / 2^20 }'
    if [ $((wheels + tree)) -gt $limit ]; then
        echo "gpu_check: over the limit; fetch 'core' only (the team run is then skipped)" >&2
        exit 1
    fi
    exit 0
fi

PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    site=${GPU_CHECK_SITE:-/tmp/flexmarl-gpu-site}
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.prefect}
export FLEXMARL_CACHE=${FLEXMARL_CACHE:-$PWD/.cache/flexmarl}
export PYTHONUNBUFFERED=1
# flexmarl is not installed here (the wheels above are its dependencies): the checkout is.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" bench/gpu_check.py "$@"
