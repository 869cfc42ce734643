"""Bad input fails early and clearly: the error names the thing that is wrong (agent and model
folder, config file, store fragment, dataset file + line/row + field), and nothing half-written
is left behind (no run folder, no fragment visible to readers)."""

from __future__ import annotations

import copy
import ctypes
import io
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexmarl_core.config import ConfigError, WorkloadConfig, load_config
from flexmarl_core.workloads import WorkloadError, make_workload
from storage import MEGStore, check_store

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
FLEXMARL = str(Path(sys.executable).with_name("flexmarl"))


def flexmarl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([FLEXMARL, *args], capture_output=True, text=True, timeout=120)


# -- (a) a model folder that is not there -----------------------------------------------------


def test_missing_model_folder_names_agent_and_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError) as exc:
        load_config(TINY, [f"team.agents.solver.model.path={missing}"])
    msg = str(exc.value)
    assert "team.agents[solver].model.path" in msg and str(missing) in msg
    assert "does not exist" in msg

    # A folder without config.json is not a model either.
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"team.agents\[planner\].model.path: .*no config.json"):
        load_config(TINY, [f"team.agents.planner.model.path={tmp_path / 'empty'}"])


def test_train_cli_with_missing_model_creates_no_run_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = flexmarl("train", str(TINY), "--set", f"run_dir={run_dir}",
                   "--set", f"team.agents.verifier.model.path={tmp_path / 'gone'}")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "team.agents[verifier].model.path" in res.stderr and "gone" in res.stderr
    assert "Traceback" not in res.stderr
    assert not run_dir.exists()  # failed before the run folder (or a Prefect server) was made


# -- (b) a config file that cannot be read ----------------------------------------------------


def _unreadable_configs(tmp_path: Path) -> list[tuple[Path, str]]:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: x\nteam:\n  agents: [oops\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: \xff\xfe\x00x\n")
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    return [
        (tmp_path / "absent.yaml", "No such file"),
        (bad_yaml, "not valid YAML at line"),
        (binary, "not UTF-8"),
        (folder, "Is a directory"),
    ]


def test_unreadable_config_raises_config_error_naming_the_file(tmp_path: Path) -> None:
    for path, why in _unreadable_configs(tmp_path):
        with pytest.raises(ConfigError) as exc:
            load_config(path)
        assert str(path) in str(exc.value) and why in str(exc.value)
        assert "\n" not in str(exc.value)


def test_unreadable_config_cli_one_line_no_traceback(tmp_path: Path) -> None:
    cases = _unreadable_configs(tmp_path)
    for path, why in cases:
        res = _train(tmp_path, str(path), "--set", f"run_dir={tmp_path / 'run'}")
        assert res.returncode == 2, (path, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0] and why in lines[0], res.stderr
    assert not (tmp_path / "run").exists()


def test_permission_denied_config(tmp_path: Path) -> None:
    cfg = tmp_path / "secret.yaml"
    cfg.write_text(TINY.read_text())
    cfg.chmod(0)
    res = subprocess.run([FLEXMARL, "train", str(cfg)], capture_output=True, text=True,
                         timeout=120, preexec_fn=_without_root_file_access())
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == f"error: {cfg}: cannot read config: Permission denied"


# -- (c) a store on a read-only or full disk --------------------------------------------------

# Capabilities that let root ignore file permissions (linux/capability.h).
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH, _PR_CAPBSET_DROP = 1, 2, 24


def _without_root_file_access():  # noqa: ANN202 - a preexec_fn
    """A preexec_fn under which file permissions apply, also when the tests run as root (CI):
    the child drops the capabilities that bypass them. Non-root: nothing to do."""
    if os.geteuid() != 0:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    probe = subprocess.run(["true"], preexec_fn=lambda: _drop(libc), capture_output=True)
    if probe.returncode != 0:
        pytest.skip("running as root without CAP_SETPCAP: cannot drop CAP_DAC_OVERRIDE")
    return lambda: _drop(libc)


def _drop(libc: ctypes.CDLL) -> None:
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


# Runs in a child process (resource limits and capabilities must not touch the test process):
# write `n` samples of `tokens` random token ids to (agent, iteration, mb), report the error.
_WRITER = """
import json, random, sys
from storage import MEGStore, StoreError
root, iteration, mb, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(0)
rows = [{"input_id": f"w{t}", "traj": 0, "turn": 0, "mb": mb, "policy_version": iteration,
         "prompt_ids": [rng.randrange(50000) for _ in range(tokens)], "response_ids": [1],
         "logprobs": [-0.5], "prompt_text": "Q", "response_text": "A"} for t in range(2)]
try:
    MEGStore(root, create=False).write_samples("solver", iteration, rows)
except StoreError as e:
    print(json.dumps({"error": str(e), "path": e.path, "reason": e.reason}))
    sys.exit(3)
"""


def _write_in_child(root: Path, iteration: int, mb: int, tokens: int, preexec) -> dict:  # noqa: ANN001
    res = subprocess.run([sys.executable, "-c", _WRITER, str(root), str(iteration), str(mb),
                          str(tokens)], capture_output=True, text=True, timeout=120,
                         preexec_fn=preexec, cwd=REPO)
    assert res.returncode == 3, res.stdout + res.stderr  # a StoreError, not a crash or success
    return json.loads(res.stdout)


def _baseline_store(root: Path) -> MEGStore:
    store = MEGStore(str(root))
    store.write_samples("solver", 0, [
        {"input_id": "p0", "traj": t, "turn": 0, "mb": 0, "policy_version": 0,
         "prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-0.5],
         "prompt_text": "Q", "response_text": "A"} for t in range(2)
    ])
    return store


def _assert_nothing_half_written(store: MEGStore, root: Path) -> None:
    assert store.read_samples("solver", 0).column("sample_id").to_pylist() == [
        "p0:0:solver:0", "p0:1:solver:0"]
    assert not list((root / "_staging").iterdir())
    assert not (root / "samples" / "agent=solver" / "iteration=1").exists()
    assert [p for p in check_store(str(root), stale_after_s=0) if p.severity == "error"] == []


def test_store_on_full_disk(tmp_path: Path) -> None:
    """A file size limit (RLIMIT_FSIZE) in the writer makes its writes fail with EFBIG, as a
    full disk fails them with ENOSPC; it applies to root too."""
    root = tmp_path / "store"
    store = _baseline_store(root)
    limit = 16 << 10  # the new fragment (2 rows x 20k random ids, ~150 KiB) cannot fit

    def small_disk() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    err = _write_in_child(root, 0, 1, 20_000, small_disk)
    assert err["reason"] == "unwritable"
    assert "samples/agent=solver/iteration=0/mb000001-" in err["path"]
    assert err["error"].startswith(f"cannot write store fragment {err['path']}: File too large")
    assert not Path(err["path"]).exists()
    _assert_nothing_half_written(store, root)

    # The same rows fit once the limit is gone (the failed write left nothing in the way).
    res = subprocess.run([sys.executable, "-c", _WRITER, str(root), "0", "1", "20000"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert store.read_samples("solver", 0).num_rows == 4


def test_store_on_read_only_disk(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = _baseline_store(root)
    preexec = _without_root_file_access()
    dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
    for d in dirs:
        d.chmod(0o555)
    try:
        # Into an existing partition (the temp file cannot be created) ...
        err = _write_in_child(root, 0, 1, 10, preexec)
        assert "samples/agent=solver/iteration=0/mb000001-" in err["path"]
        assert "Permission denied" in err["error"] and err["reason"] == "unwritable"
        # ... and into a new one (its directory cannot be created).
        err = _write_in_child(root, 1, 0, 10, preexec)
        assert "samples/agent=solver/iteration=1/mb000000-" in err["path"]
        assert "Permission denied" in err["error"]
        # A new store under a read-only folder: the error names the store.
        res = subprocess.run(
            [sys.executable, "-c", "import sys; from storage import MEGStore, StoreError\n"
             "try: MEGStore(sys.argv[1])\nexcept StoreError as e: sys.exit(str(e))",
             str(root / "samples" / "new")],
            capture_output=True, text=True, timeout=60, preexec_fn=preexec, cwd=REPO)
        assert res.stderr.startswith(f"cannot create a MEG store at {root / 'samples' / 'new'}")
    finally:
        for d in dirs:
            d.chmod(0o755)
    _assert_nothing_half_written(store, root)


# -- (d) dataset rows that cannot be parsed ---------------------------------------------------

TEAM = load_config(TINY).team


def _dataset(path: Path, **fields: str) -> None:
    cfg = WorkloadConfig(kind="dataset", path=str(path),
                         fields=fields or {"input": "q", "answer": "a"})
    make_workload(cfg, TEAM)


def test_gzipped_jsonl_broken_line_names_file_and_line(tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write('{"q": "1+1", "a": 2}\n\n{"q": "2+2", "a": 4}\n{"q": "3+3", "a": \n')
    with pytest.raises(WorkloadError, match=r"d\.jsonl\.gz: line 4: not valid JSON"):
        _dataset(path)


def test_parquet_missing_mapped_field_names_file_row_and_field(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"q": [f"{i}+1" for i in range(4)], "answer_text": ["x"] * 4}), path)
    with pytest.raises(WorkloadError) as exc:
        _dataset(path, input="q", answer="a")
    msg = str(exc.value)
    assert f"{path}: row 0: no column 'a' (workload.fields.answer)" in msg
    assert "answer_text" in msg  # the columns it does have, to spot the mapping typo


def test_bad_dataset_stops_train_cli_naming_the_line(tmp_path: Path) -> None:
    """Through the command line a broken row is a one-line error, not a Prefect traceback."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "1+1", "a": 2}\n{"q": "2+2", "a": 4\n')
    res = flexmarl("train", str(TINY), "--set", f"run_dir={tmp_path / 'run'}",
                   "--set", "workload.kind=dataset", "--set", f"workload.path={data}",
                   "--set", "workload.fields={input: q, answer: a}", "--set", "workload.params={}")
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"{data}: line 2: not valid JSON" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()


# -- (e) a corpus of bad configs and arguments through the command line ------------------------

TINY_DATA = yaml.safe_load(TINY.read_text())
DEAD = "tls://127.0.0.1:1"  # a privileged port nothing listens on: connection refused


def _set(dotted: str, value: Any) -> Callable[[dict], None]:
    """A mutation of the tiny config: `team.agents.1.name` style paths, list items by index."""

    def apply(data: dict) -> None:
        *path, last = dotted.split(".")
        node: Any = data
        for key in path:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        node[int(last) if isinstance(node, list) else last] = value

    return apply


#: (id, mutations of configs/tiny.yaml, what the one error line must say)
BAD_CONFIGS: list[tuple[str, list[Callable[[dict], None]], str]] = [
    ("duplicate-agent", [_set("team.agents.0.name", "solver")], "duplicate agent name(s): ['solver']"),
    ("edge-to-unknown-agent", [_set("team.edges", ["planner -> ghost"])], "unknown agent 'ghost'"),
    ("cycle", [_set("team.edges", ["planner -> solver", "solver -> verifier", "verifier -> planner"])],
     "cycle in the team graph"),
    ("placeholder-not-a-parent", [_set("team.agents.1.template", "{input} {verifier}")],
     "template placeholder(s) ['verifier']"),
    ("bad-template-braces", [_set("team.agents.1.template", "{input")], "bad prompt template"),
    ("empty-team", [_set("team.agents", []), _set("team.edges", [])], "the team has no agents"),
    ("output-not-an-agent", [_set("team.output", "ghost")], "team.output 'ghost' is not an agent"),
    ("share-model-with-unknown", [_set("team.agents.1.share_model_with", "ghost")],
     "share_model_with 'ghost' is not an agent"),
    ("run-name-escapes-runs", [_set("name", "../../x")], "run name '../../x'"),
    ("run-name-with-slash", [_set("name", "a/b")], "run name 'a/b'"),
    ("empty-run-name", [_set("name", "")], "run name ''"),
    ("run-dir-unknown-placeholder", [_set("run_dir", "runs/{nam}")], "unknown placeholder(s) ['nam']"),
    ("store-uri-unbalanced", [_set("store.uri", "{run_dir}/{store")], "store.uri: '{run_dir}/{store'"),
    ("unknown-preset", [_set("team.agents.0.model", {"preset": "tiny-9m"})],
     "team.agents[planner].model.preset: unknown preset 'tiny-9m'"),
    ("negative-group-size", [_set("batch.group_size", -4)], "batch.group_size"),
    ("micro-batch-not-dividing", [_set("batch", {"inputs_per_iteration": 6, "micro_batch_inputs": 4})],
     "micro_batch_inputs=4 must divide inputs_per_iteration=6"),
    ("zero-iterations", [_set("train.iterations", 0)], "train.iterations"),
    ("unknown-key", [_set("batch.size", 8)], "batch.size: Extra inputs are not permitted"),
    ("unknown-workload", [_set("workload.kind", "chess")], "workload.kind"),
    ("missing-dataset", [_set("workload", {"kind": "dataset", "path": "nope.jsonl"})], "nope.jsonl: no such file"),
    ("unreachable-cluster", [_set("cluster.address", DEAD)],
     f"cluster.address '{DEAD}': no scheduler reachable at 127.0.0.1:1"),
    ("malformed-cluster-address", [_set("cluster.address", "host:port")],
     "cluster.address 'host:port' is not a Dask scheduler address"),
    ("unreachable-prefect-api", [_set("cluster.prefect_api_url", "http://127.0.0.1:1/api")],
     "cluster.prefect_api_url is http://127.0.0.1:1/api, but no Prefect API answers there"),
    ("duplicate-worker", [_set("cluster.workers", [{"name": "w0"}, {"name": "w0"}])],
     "duplicate worker name(s) ['w0']"),
    ("no-workers", [_set("cluster.workers", [])], "cluster: no workers: a local cluster needs"),
    ("tag-names-no-agent", [_set("cluster.workers.0.resources", {"rollout:solvr": 1, "train": 1})],
     "cluster.workers[w0].resources: tag 'rollout:solvr' names no agent"),
    ("no-rollout-instance", [_set("cluster.workers", [{"name": "w0", "resources": {"train": 1}}])],
     "no worker has a 'rollout' or 'rollout:<agent>' tag"),
    ("no-train-slot", [_set("cluster.workers", [{"name": "w0", "resources": {"rollout": 1}}])],
     "no worker has the 'train' tag"),
    ("agent-without-instance", [_set("codesign.load_balancing", False), _set("cluster.workers", [
        {"name": "w0", "resources": {"rollout:planner": 1, "rollout:solver": 1, "train": 1}}])],
     "agent(s) ['verifier'] have no 'rollout:<agent>' worker"),
    ("missing-init-from", [_set("train.init_from", "sft-out")],
     "train.init_from 'sft-out': no <agent>/model.safetensors"),
]


def _one_error_line(res: subprocess.CompletedProcess, cwd: Path) -> str:
    """Exit 2, one `error:` line and nothing else, no traceback, no run folder."""
    out = (res.stdout + res.stderr).strip()
    assert res.returncode == 2, out
    assert "Traceback" not in out, out
    lines = out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert not (cwd / "runs").exists()  # runs/<name> would be made in the working directory
    return lines[0]


#: a Prefect API that does not answer: a config that got past every check would stop there
#: (with an error line that is not the expected one) instead of starting a server and a run
DEAD_API = "http://127.0.0.1:1/api"


def _train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`flexmarl train ARGS` from `cwd`, through the CLI's own `main` in this process: the same
    checks and error lines as the command, without a fresh interpreter importing torch for each
    of these cases (~2-9 s apiece here). The environment the CLI sets is put back afterwards.
    The command itself, as a process, is the subject of the tests that call `flexmarl(...)`."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flexmarl.cli import main

    out, err, env, here = io.StringIO(), io.StringIO(), dict(os.environ), os.getcwd()
    os.environ["PREFECT_API_URL"] = DEAD_API
    os.chdir(cwd)
    try:
        with temporary_settings(updates={PREFECT_API_URL: DEAD_API}), redirect_stdout(out), redirect_stderr(err):
            try:
                rc = main(["train", *args])
            except SystemExit as exc:  # argparse's own errors
                rc = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(env)
    return subprocess.CompletedProcess(["flexmarl", "train", *args], rc, out.getvalue(), err.getvalue())


@pytest.mark.parametrize(("mutations", "says"), [
    pytest.param(*c[1:], id=c[0]) for c in BAD_CONFIGS])
def test_bad_config_is_one_error_line_exit_2(tmp_path: Path, mutations: list, says: str) -> None:
    data = copy.deepcopy(TINY_DATA)
    for mutate in mutations:
        mutate(data)
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    line = _one_error_line(_train(tmp_path, "bad.yaml"), tmp_path)
    assert says in line, line


BAD_ARGS: list[tuple[str, list[str], str]] = [
    ("no-config", [], "give a CONFIG file, or --resume RUN"),
    ("missing-config-file", ["absent.yaml"], "absent.yaml: cannot read config: No such file"),
    ("set-without-equals", [str(TINY), "--set", "seed"], "override 'seed' must look like key.path=value"),
    ("set-bad-yaml", [str(TINY), "--set", "seed=[1"], "the value is not valid YAML"),
    ("set-no-key", [str(TINY), "--set", "=3"], "override '=3' has no key"),
    ("set-index-past-end", [str(TINY), "--set", "team.agents.7.trainable=false"],
     "index 7 is past the end of a list of 3"),
    ("set-unknown-agent", [str(TINY), "--set", "team.agents.ghost.trainable=false"],
     "no list item named 'ghost'"),
    ("unknown-flag", [str(TINY), "--bogus"], "unrecognized arguments: --bogus"),
    ("config-and-resume", [str(TINY), "--resume", "runs/x"], "give either CONFIG or --resume RUN"),
    ("resume-not-a-run", ["--resume", "."], "no config.yaml there"),
]


@pytest.mark.parametrize(("args", "says"), [c[1:] for c in BAD_ARGS], ids=[c[0] for c in BAD_ARGS])
def test_bad_arguments_are_one_error_line_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    line = _one_error_line(_train(tmp_path, *args), tmp_path)
    assert says in line, line


def test_unreachable_cluster_fails_in_seconds_by_name() -> None:
    """The flow's own cluster start (deployments skip the CLI's checks) says the same."""
    from flexmarl_core.cluster import start_cluster
    from flexmarl_core.config import ClusterConfig

    with pytest.raises(ConfigError, match=r"cluster.address 'tls://127.0.0.1:1': no scheduler"):
        start_cluster(ClusterConfig(address=DEAD))


def test_fresh_run_never_replaces_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    """`run_dir` pointing at a folder of other files: refused by name, the files untouched."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    data = copy.deepcopy(TINY_DATA)
    data["run_dir"] = "mine"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    line = _one_error_line(_train(tmp_path, "bad.yaml"), tmp_path)
    assert "is not a flexmarl run folder" in line, line
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_project_folder_with_a_config_file_is_not_a_run_folder(tmp_path: Path) -> None:
    """A `config.yaml` alone (a project's, not a run's) does not make a folder replaceable."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "config.yaml").write_text("name: something else\n")
    (tmp_path / "proj" / "main.py").write_text("print('mine')\n")
    data = copy.deepcopy(TINY_DATA)
    data["run_dir"] = "proj"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    line = _one_error_line(_train(tmp_path, "bad.yaml"), tmp_path)
    assert "is not a flexmarl run folder" in line, line
    assert (tmp_path / "proj" / "main.py").exists()


def test_init_from_inside_the_run_folder_is_refused(tmp_path: Path) -> None:
    """A fresh run replaces its run folder: starting checkpoints kept inside it would go too."""
    ckpt = tmp_path / "run" / "sft"
    for agent in ("planner", "solver", "verifier"):
        (ckpt / agent).mkdir(parents=True)
        (ckpt / agent / "model.safetensors").write_bytes(b"x")
    (tmp_path / "run" / ".flexmarl-run").touch()
    data = copy.deepcopy(TINY_DATA)
    data["run_dir"] = "run"
    data["train"] = {**data.get("train", {}), "init_from": str(ckpt)}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    out = _train(tmp_path, "bad.yaml")
    assert out.returncode == 2 and "lies inside run_dir" in out.stderr, out.stderr
    assert (ckpt / "solver" / "model.safetensors").exists()
