"""The sandbox against a corpus of hostile and benign programs: real processes, real limits.

Every hostile program must end with reward 0 and its reason, inside its limits, with every
file outside the sandbox unchanged and the parent (this process) alive; benign programs must
pass, and a benign program after the hostile ones still passes (the sandbox carries on).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from flexmarl_core.sandbox import Limits, protections, run_tests

REPO = Path(__file__).resolve().parents[2]
FAST = Limits(cpu_s=1, wall_s=3, memory_mb=256, output_bytes=1 << 16)
#: for programs that must end on their CPU limit, or pass: a loaded machine gives a child a
#: fraction of a core, so 1 CPU-second can take several wall seconds, and a start-up too
ROOMY = Limits(cpu_s=1, wall_s=30, memory_mb=256, output_bytes=1 << 16)
#: the parent never waits on a program past its limits: far less than the 60 s one sleeps
NEVER_WAITS_S = 30
TESTS = ["assert candidate(1) == 4", "assert candidate(2) == 7", "assert candidate(-3) == -8"]
RIGHT = "def f(x):\n    return 3 * x + 1\n"


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A world-writable folder with a file: what a hostile program tries to change."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "keep.txt").write_text("precious")
    d.chmod(0o777)
    (d / "keep.txt").chmod(0o666)
    return d


# name -> (code with {out} for the outside folder, expected reason, a word of the detail)
HOSTILE: dict[str, tuple[str, str, str]] = {
    "print_pass": ("print('PASS')\nprint('3 passed')\ndef f(x):\n    print('PASS')\n    return 0\n",
                   "failed", "AssertionError"),
    "exit0_top": ("import sys\nsys.exit(0)\n", "load_error", "SystemExit"),
    "os_exit_top": ("import os\nos._exit(0)\n", "exited", "exit status 0"),
    "os_exit_in_test": ("import os\ndef f(x):\n    os._exit(0)\n", "exited", "exit status 0"),
    "system_exit_in_test": ("def f(x):\n    raise SystemExit(0)\n", "failed", "SystemExit"),
    "patch_builtins": ("import builtins\nclass Yes:\n    def __eq__(self, o):\n        return True\n"
                       "builtins.AssertionError = type('N', (BaseException,), {})\n"
                       "builtins.isinstance = lambda *a: True\n"
                       "def f(x):\n    return Yes()\n", "exited", "exit status"),
    "patch_harness": ("import sys\nh = sys.modules['__main__']\nw = h.write_frame\n"
                      "h.write_frame = lambda fd, obj: w(fd, {'ok': True})\n"
                      "h.encode = lambda v: True\ndef f(x):\n    return None\n",
                      "failed", "AssertionError"),
    "forge_reply": ("import os, json\ndef f(x):\n    for fd in range(3, 256):\n        try:\n"
                    "            b = json.dumps({'verdict': 'passed', 'passed': 3}).encode()\n"
                    "            os.write(fd, len(b).to_bytes(4, 'big') + b)\n"
                    "        except OSError:\n            pass\n    return 0\n",
                    "bad_reply", "unexpected reply"),
    "read_tests": ("import os\ndef f(x):\n    return open('/proc/%d/cmdline' % os.getppid()).read()\n",
                   "forbidden", "outside the sandbox"),
    "rewrite_tests": ("def f(x):\n    open(__file__, 'w').write('assert True')\n", "failed",
                      "NameError"),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()\n", "forbidden", "os.fork"),
    "infinite_loop": ("def f(x):\n    while True:\n        pass\n", "cpu_limit", "CPU time"),
    "sleep_past_limit": ("import time\ndef f(x):\n    time.sleep(60)\n", "timeout", "wall time"),
    "memory_bomb": ("def f(x):\n    a = [bytearray(1 << 26) for _ in range(100)]\n    return 0\n",
                    "memory_limit", "MemoryError"),
    "memory_bomb_top": ("a = 'x' * (1 << 34)\n", "memory_limit", "MemoryError"),
    "gigabytes_of_output": ("import sys\ndef f(x):\n    while True:\n        sys.stdout.write('x' * (1 << 20))\n",
                            "output_limit", "output over"),
    "delete_outside": ("import os\nos.remove('{out}/keep.txt')\n", "forbidden", "os.remove"),
    "rmtree_outside": ("import shutil\nshutil.rmtree('{out}')\n", "forbidden", "rmtree"),
    "write_outside": ("open('{out}/keep.txt', 'w').write('gone')\n", "forbidden", "outside"),
    "write_repo": (f"open({str(REPO / 'README.md')!r}, 'a').write('x')\n", "forbidden", "outside"),
    "socket": ("import socket\ns = socket.create_connection(('1.1.1.1', 80))\n", "forbidden",
               "import socket"),
    "socket_low_level": ("_socket = __import__('_socket')\n", "forbidden", "import _socket"),
    "kill_parent": ("import os, signal\nos.kill(os.getppid(), 9)\n", "forbidden", "import signal"),
    "kill_parent_os": ("import os\nos.kill(os.getppid(), 9)\n", "forbidden", "os.kill"),
    "subprocess": ("import os\nos.system('rm -rf {out}')\n", "forbidden", "os.system"),
    "ctypes": ("import ctypes\nctypes.CDLL(None).kill(1, 9)\n", "forbidden", "import ctypes"),
    "gc_hook_tamper": ("import gc\nfor o in gc.get_objects():\n    pass\n", "forbidden", "gc.get_objects"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_scores_zero_with_its_reason_and_changes_nothing(name, outside):
    code, reason, word = HOSTILE[name]
    before_outside, before_repo = _tree(outside), _tree(REPO / "flexmarl_core" / "sandbox")
    t0 = time.monotonic()
    v = run_tests(code.replace("{out}", str(outside)), TESTS, ROOMY if reason == "cpu_limit" else FAST, entry="f")
    assert time.monotonic() - t0 < NEVER_WAITS_S
    assert (v.reason, v.passed, v.reward) == (reason, 0, 0.0), v
    assert word in v.detail, v
    assert v.total == len(TESTS) and not any(v.results)
    assert _tree(outside) == before_outside
    assert _tree(REPO / "flexmarl_core" / "sandbox") == before_repo
    # The run carries on: the next program is judged normally.
    assert run_tests(RIGHT, TESTS, ROOMY, entry="f").reason == "passed"


BENIGN: dict[str, tuple[str, list[str]]] = {
    "arith": (RIGHT, TESTS),
    "stdlib": ("import math, itertools, collections, re, functools, heapq\n"
               "def f(xs):\n    c = collections.Counter(xs)\n"
               "    return (math.gcd(*xs), sorted(c.items()), re.sub('a', 'b', 'aa'), "
               "list(itertools.accumulate(xs)), heapq.nsmallest(1, xs))\n",
               ["assert candidate([4, 6, 4]) == (2, [(4, 2), (6, 1)], 'bb', [4, 10, 14], [4])"]),
    "values": ("def f(n):\n    return [None, True, 2 ** 100, float('inf'), 1.5, b'x', {1, 2},"
               " {'a': (1,)}, frozenset(), 1j]\n",
               ["assert candidate(0) == [None, True, 2 ** 100, float('inf'), 1.5, b'x', {1, 2},"
                " {'a': (1,)}, frozenset(), 1j]"]),
    "own_files": ("import os, tempfile\ndef f(x):\n    with open('scratch.txt', 'w') as fh:\n"
                  "        fh.write(str(x))\n    os.listdir('.')\n"
                  "    with tempfile.TemporaryFile() as t:\n        t.write(b'1')\n"
                  "    return int(open('scratch.txt').read())\n",
                  ["assert candidate(5) == 5"]),
    "recursion_and_stdout": ("def f(n):\n    print('working', n)\n    return 1 if n < 2 else f(n - 1) + f(n - 2)\n",
                             ["assert candidate(15) == 987"]),
    # What Python runs, the sandbox runs: the program is a real module while it loads.
    "dataclass": ("from dataclasses import dataclass, field\n@dataclass(frozen=True, order=True)\n"
                  "class P:\n    x: int\n    tags: list = field(default_factory=list, compare=False)\n"
                  "def f(n):\n    return sorted(P(i) for i in range(n, 0, -1))[0].x\n",
                  ["assert candidate(3) == 1"]),
    "enum": ("import enum\nclass Op(enum.Enum):\n    ADD = '+'\n    MUL = '*'\n"
             "class Flag(enum.IntFlag):\n    A = 1\n    B = 2\n"
             "def f(s):\n    return [Op(c).name for c in s] + [int(Flag.A | Flag.B)]\n",
             ["assert candidate('+*') == ['ADD', 'MUL', 3]"]),
    "typing": ("from __future__ import annotations\nimport typing\n"
               "class Pair(typing.NamedTuple):\n    a: int\n    b: int\n"
               "class Row(typing.TypedDict):\n    n: int\n"
               "def f(x: int) -> Pair:\n    hints = typing.get_type_hints(f)\n"
               "    return (Pair(x, x + 1)._asdict()['b'], sorted(hints), Row(n=x)['n'])\n",
               ["assert candidate(2) == (3, ['return', 'x'], 2)"]),
    "functools": ("import functools\n@functools.total_ordering\nclass V:\n    def __init__(self, v):\n"
                  "        self.v = v\n    def __eq__(self, o):\n        return self.v == o.v\n"
                  "    def __lt__(self, o):\n        return self.v < o.v\n"
                  "@functools.singledispatch\ndef size(x):\n    return 1\n@size.register\ndef _(x: list):\n"
                  "    return len(x)\n@functools.lru_cache(maxsize=None)\ndef fib(n):\n"
                  "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
                  "def f(n):\n    return (fib(n), size([1, 2]), size(3), V(1) <= V(2))\n",
                  ["assert candidate(30) == (832040, 2, 1, True)"]),
    "pickle_own_class": ("import pickle, copy\nclass Node:\n    def __init__(self, v):\n        self.v = v\n"
                         "def f(v):\n    n = pickle.loads(pickle.dumps(Node(v)))\n    return copy.deepcopy(n).v\n",
                         ["assert candidate(7) == 7"]),
}


@pytest.mark.parametrize("name", sorted(BENIGN))
def test_benign_program_passes(name):
    code, tests = BENIGN[name]
    v = run_tests(code, tests, ROOMY, entry="f")
    assert (v.reason, v.passed, v.total) == ("passed", len(tests), len(tests)), v
    assert 0 < v.wall_s < ROOMY.wall_s and 0 < v.memory_mb < 200


def test_a_program_that_stops_reading_cannot_stall_the_parent():
    """After one call it never reads again: the parent's next, bigger-than-a-pipe request
    must still end at the wall limit, not block the worker."""
    code = ("import sys, time\nh = sys.modules['__main__']\n"
            "def f(x):\n    h.read_frame = lambda fd: time.sleep(60)\n    return len(x)\n")
    t0 = time.monotonic()
    v = run_tests(code, ["assert candidate([1]) == 1", "assert candidate(list(range(50000))) == 50000"],
                  FAST, entry="f")
    assert (v.reason, v.passed) == ("timeout", 0) and time.monotonic() - t0 < NEVER_WAITS_S
    big = run_tests(RIGHT.replace("3 * x + 1", "len(x)"), ["assert candidate(list(range(50000))) == 50000"],
                    ROOMY, entry="f")
    assert big.reason == "passed", big


def test_partial_credit_and_per_test_results():
    v = run_tests("def f(x):\n    return 3 * x + 1 if x > 0 else 0\n", TESTS, ROOMY, entry="f")
    assert (v.reason, v.passed, v.results) == ("failed", 2, (True, True, False))
    assert v.reward == pytest.approx(2 / 3)
    assert "test 2" in v.detail


def test_the_tests_reach_every_function_the_program_defines_but_never_over_a_builtin():
    """As in HumanEval's harness, a test may call the program's helpers by name; a helper
    named like a builtin (or a prelude name) does not replace it in the tests, so a program
    cannot rig the test's own arithmetic."""
    code = ("def helper(x):\n    return x * 2\n"
            "def abs(x):\n    return 0\n"
            "def f(x):\n    return helper(x) + 1\n")
    tests = ["assert helper(3) == 6 and candidate(3) == 7",
             "assert abs(candidate(3) - 100) < 1",  # Python's abs: this test must fail
             "assert prelude_fn(2) == 'prelude'"]
    v = run_tests(code, tests, ROOMY, entry="f", prelude="def prelude_fn(x):\n    return 'prelude'\n")
    assert v.results == (True, False, True), v


def test_missing_entry_and_syntax_error():
    assert run_tests(RIGHT, TESTS, ROOMY, entry="g").detail.startswith("test 0: CandidateError: NameError")
    v = run_tests("def f(x) return", TESTS, ROOMY, entry="f")
    assert (v.reason, v.passed) == ("load_error", 0) and "SyntaxError" in v.detail


def test_the_os_layer_holds_without_the_audit_hook(monkeypatch):
    """What the program sees through calls the audit hook does not watch: no hidden folder,
    no secrets, another uid."""
    monkeypatch.setenv("FLEXMARL_SECRET", "s3cret")
    code = ("import os\ndef f(paths):\n    return ([os.path.exists(p) for p in paths], "
            "sorted(os.environ), os.getuid())\n")
    paths = [str(REPO / "README.md"), str(Path.home()), "/etc/hostname"]
    v = run_tests(code, [f"r = candidate({paths!r})\nassert r[0][:1] == [False]\n"
                         "assert not any('SECRET' in k for k in r[1])\nassert r[2] != 0"], ROOMY, entry="f")
    report = protections()
    if os.geteuid() == 0 and report["network"].startswith("on") and report["filesystem"].startswith("on"):
        assert v.reason == "passed", v
    else:
        pytest.skip(f"namespaces are off here: {report}")


def test_protections_name_every_layer_on_or_off():
    report = protections()
    for key in ("network", "filesystem", "user", "processes", "limits", "verdict", "audit hook"):
        assert report[key].split(":")[0] in ("on", "off", "partial"), report


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare command here")
def test_without_namespaces_or_uids_the_sandbox_says_what_is_off_and_still_judges():
    """In a user namespace with no uid map nothing can be unshared or chowned: the report
    says so, and the verdicts (decided in the parent) and the audit hook still hold."""
    script = (
        "import json\nfrom flexmarl_core.sandbox import Limits, protections, run_tests\n"
        f"print(json.dumps([protections()] + [run_tests(c, {TESTS!r}, Limits(cpu_s=1), entry='f').reason "
        f"for c in ({RIGHT!r}, 'import os\\nos.fork()', 'def f(x):\\n    while 1: pass', "
        "'import os\\ndef f(x):\\n    os._exit(0)')]))\n"
    )
    out = subprocess.run(["unshare", "-U", sys.executable, "-c", script], capture_output=True,
                         text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    if out.returncode and "unshare failed" in out.stderr:
        pytest.skip(f"user namespaces are not allowed here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    report, *reasons = json.loads(out.stdout)
    assert reasons == ["passed", "forbidden", "cpu_limit", "exited"]
    off = {k for k, v in report.items() if v.startswith("off")}
    assert {"network", "filesystem", "user"} <= off, report
    assert all(len(report[k]) > len("off: ") for k in off)


def test_bad_limits_are_one_line_errors():
    with pytest.raises(ValueError, match="wall_s"):
        Limits(wall_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb=8)


# -- where the caller stands, threads, a sandbox that cannot start ---------------------------

THREADED = ("import threading\ndef f(x):\n    out = []\n    t = threading.Thread(target=lambda: out.append(3 * x + 1))\n"
            "    t.start()\n    t.join()\n    return out[0]\n")
THREAD_BOMB = ("import threading, time\ndef f(x):\n    while True:\n"
               "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")


def _cwd_under_home() -> Path:
    return Path(tempfile.mkdtemp(prefix=".flexmarl-test-cwd-", dir=Path.home()))


@pytest.mark.parametrize("where", ["/tmp", "/", "home"])
def test_the_callers_working_directory_does_not_break_the_sandbox(where, monkeypatch):
    """The working directory is hidden from the program, whatever it is: /tmp (already a private
    tmpfs in the program's view: hiding it again hid the interpreter), / (the system), a folder
    under $HOME. A right program passes from each; a hostile one still scores 0."""
    folder = _cwd_under_home() if where == "home" else Path(where)
    try:
        monkeypatch.chdir(folder)
        assert run_tests(RIGHT, TESTS, ROOMY, entry="f").reason == "passed"
        assert run_tests("import os\nos.fork()\n", TESTS, ROOMY, entry="f").reason == "forbidden"
    finally:
        if where == "home":
            shutil.rmtree(folder)


def test_an_interpreter_under_a_hidden_folder_is_bound_back():
    """A venv's base interpreter under a folder the program must not see (pyenv or uv under
    $HOME): the folder is hidden, the interpreter's own prefix is mounted back read-only."""
    hidden = os.path.dirname(os.path.realpath(sys.base_prefix))
    sibling = next((str(p) for p in Path(hidden).iterdir()
                    if p.resolve() != Path(sys.base_prefix).resolve()), None)
    limits = Limits(cpu_s=1, wall_s=30, memory_mb=256, hide=(hidden,))
    assert run_tests(RIGHT, TESTS, limits, entry="f").reason == "passed"
    if sibling is not None and protections()["filesystem"].startswith("on"):
        seen = run_tests("import os\ndef g(p):\n    return os.path.exists(p)\n",
                         [f"assert candidate({sibling!r}) is False"], limits, entry="g")
        assert seen.reason == "passed", seen


def test_threads_a_few_pass_a_bomb_is_contained():
    """Library code that starts a helper thread passes under the default limit; with
    `threads=0` it fails; a thread bomb stops at the cap and fails, well inside its wall time."""
    assert run_tests(THREADED, TESTS, ROOMY, entry="f").reason == "passed"
    none = run_tests(THREADED, TESTS, Limits(cpu_s=1, wall_s=30, memory_mb=256, threads=0), entry="f")
    assert (none.reason, none.passed) == ("failed", 0) and "can't start new thread" in none.detail, none
    if not protections()["processes"].startswith("on"):
        pytest.skip(f"RLIMIT_NPROC does not bind here: {protections()['processes']}")
    t0 = time.monotonic()
    bomb = run_tests(THREAD_BOMB, TESTS, ROOMY, entry="f")
    assert bomb.passed == 0 and bomb.reason in ("failed", "cpu_limit", "memory_limit"), bomb
    assert time.monotonic() - t0 < NEVER_WAITS_S
    assert run_tests("import os\nos.fork()\n", TESTS, ROOMY, entry="f").reason == "forbidden"


@pytest.mark.parametrize("limits, says", [
    (Limits(python="/nonexistent/python3"), "/nonexistent/python3"),
    (Limits(python="/bin/false"), "exited 1"),
    (Limits(open_files=3), "cannot start programs"),  # Python cannot open its own libraries
])
def test_a_sandbox_that_cannot_start_a_program_raises_and_gives_no_verdict(limits, says):
    """The interpreter unreachable or a limit it cannot start under: `SandboxError` (not
    retryable), never a verdict that would score the program 0."""
    from flexmarl_core.sandbox import SandboxError
    from flexmarl_core.stages.registry import retryable

    with pytest.raises(SandboxError, match="cannot start programs") as info:
        run_tests(RIGHT, TESTS, limits, entry="f")
    assert says in str(info.value)
    assert not retryable(info.value)
    wrapped = RuntimeError("reward failed")
    wrapped.__cause__ = info.value
    assert not retryable(wrapped) and retryable(RuntimeError("a passing fault"))
