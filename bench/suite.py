"""The test suite's own cost, as a developer and CI meet it: a fresh clone of COMMIT, then
`make test` (the unit and stack tiers, setup included) or, with `--ci`, `bash .ci/run` (the
scale-out extras installed, then every tier), timed, with the machine's load.

    python bench/suite.py --json bench/results/suite-make-test.json          # make test
    python bench/suite.py --json bench/results/suite-ci.json --ci            # .ci/run
    python bench/suite.py --json /tmp/suite.json --quick                     # make test-unit

The public datasets' folder comes from `FLEXMARL_DATA` (as for the tests; `.ci/run` looks
beside the clone otherwise). pytest writes a JUnit report, from which each tier's test time
(the sum of its tests' setup, call and teardown) and the 15 slowest tests come. JSON keys:
`command`, `commit`, `wall_s` (the whole command, setup included), `setup_s` (the clone's
`make setup` or `setup-scale`, timed on its own first), `tests_s` (wall of the test command
alone), `tiers` (per tier: `tests`, `passed`, `failed`, `skipped`, `test_s`), `slowest`,
`load` (mean and max of the 1-minute load average, sampled every 5 s).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

from _fresh import LoadSampler, fresh_clone  # bench/ is this script's folder

REPO = Path(__file__).resolve().parents[1]
TIERS = ("unit", "stack", "slow")


def junit_tiers(path: Path) -> tuple[dict[str, dict[str, float]], list[dict[str, object]]]:
    """Per tier: counts and summed test time; and the 15 slowest tests, from a JUnit report."""
    tiers: dict[str, collections.Counter] = {t: collections.Counter() for t in TIERS}
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "")  # tests.unit.test_x (or tests.unit.test_x.Class)
        parts = cls.split(".")
        tier = parts[1] if len(parts) > 1 and parts[1] in TIERS else "other"
        t = float(case.get("time", 0.0))
        c = tiers.setdefault(tier, collections.Counter())
        c["tests"] += 1
        c["test_s"] += t
        if case.find("skipped") is not None:
            c["skipped"] += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            c["failed"] += 1
        else:
            c["passed"] += 1
        cases.append({"test": f"{cls.replace('.', '/')}.py::{case.get('name')}", "s": round(t, 1)})
    out = {t: {k: round(v, 1) if k == "test_s" else int(v) for k, v in c.items()} for t, c in tiers.items() if c}
    return out, sorted(cases, key=lambda c: -float(c["s"]))[:15]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, metavar="OUT")
    ap.add_argument("--quick", action="store_true", help="the unit tier alone (make test-unit)")
    ap.add_argument("--ci", action="store_true", help="bash .ci/run: the extras, then every tier")
    ap.add_argument("--commit", default="HEAD")
    args = ap.parse_args()

    sha, work, clone = fresh_clone(REPO, args.commit, "flexmarl-suite-")
    junit = work / "junit.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "VIRTUAL_ENV", "PYTEST_"))}
    env["PYTEST_ADDOPTS"] = f"--junitxml={junit}"
    env["CI"] = "true" if args.ci else env.get("CI", "")
    setup_target = "setup-scale" if args.ci else "setup"
    test_cmd = (["bash", ".ci/run"] if args.ci else ["make", "test-unit" if args.quick else "test"])
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    started = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    load = LoadSampler()
    load.start()
    t0 = time.monotonic()
    # Setup on its own first (the test command finds it done), so the two are timed apart.
    subprocess.run(["make", setup_target], cwd=clone, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    setup_s = time.monotonic() - t0
    t1 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(test_cmd, cwd=clone, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    tests_s = time.monotonic() - t1
    loads = load.stop()
    tiers, slowest = junit_tiers(junit) if junit.exists() else ({}, [])
    record = {
        "command": " ".join(test_cmd), "commit": sha, "start_utc": started, "exit_code": rc,
        "data": env.get("FLEXMARL_DATA") or None,
        "wall_s": round(setup_s + tests_s, 1), "setup_s": round(setup_s, 1), "tests_s": round(tests_s, 1),
        "tiers": tiers, "slowest": slowest, "load": loads,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    per = ", ".join(f"{t} {v.get('passed', 0)} passed {v.get('test_s', 0) / 60:.1f} min" for t, v in tiers.items())
    print(f"{record['command']}: exit {rc}; setup {setup_s / 60:.1f} min + tests {tests_s / 60:.1f} min; {per}; "
          f"load mean {loads['mean']} max {loads['max']}")
    sys.exit(rc)


if __name__ == "__main__":
    main()
