"""The chaos bench's short variant (`bench/chaos.py` on the tiny team, 3 iterations): worker
kills, a Prefect API outage, a burst of S3 errors and a hung op in one run on the real stack,
which loses and duplicates nothing, ends with the undisturbed run's weights, and shows every
fault in its decision log (the API outage as every op's task run completed afterwards)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]



def test_chaos_short_variant_loses_nothing(tmp_path: Path) -> None:
    from tests._s3 import require_moto

    require_moto()
    out = tmp_path / "chaos.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--config", str(REPO / "configs" / "tiny.yaml"),
                          "--iterations", "3", "--outage-s", "10", "--no-operator", "--json", str(out),
                          # the hung op is caught after 30 s: the S3 burst backs off 7 s at most (store.retries), so only the hang trips it
                          "--deadline-floor-s", "30"],
                         cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert out.exists(), (res.stdout + res.stderr)[-4000:]
    got = json.loads(out.read_text())
    assert got["faults_injected"] >= 5 and got["faults_survived"] == got["faults_injected"], got["faults"]
    assert got["audit_errors"] == 0 and got["weights_tolerance_ratio"] <= 1.0, got
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
