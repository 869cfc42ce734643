"""Hosts of their own on one Linux machine, for tests and drills: each host a network namespace
with its own address on a private bridge, so processes that share nothing share no loopback
either, and every connection between them crosses a network interface.

    with Network(["store", "scheduler", "worker-a"]) as net:
        net["store"].ip                                  # 10.231.N.2
        net["store"].popen([sys.executable, ...], env=...)   # `ip netns exec <ns> ...`

The bridge lives in a namespace of its own (the "switch"); each host's `eth0` is a veth whose
peer is a port of it, and this process (the controller: the test, the operator's shell)
reaches every host through one more veth holding the subnet's .1. Not a bridge in the root
namespace: with br_netfilter loaded (Docker loads it), bridged frames pass the root
namespace's iptables FORWARD chain, whose policy Docker sets to DROP; a new namespace has no
rules. The subnet, 10.231.N.0/24, is one that no address or route here uses yet, picked under
a lock; names carry a random suffix (namespaces `fmx<suffix>-<host>`, the controller's veth
`fmx<suffix>c`: interface names have at most 15 characters), so concurrent runs never clash.
`down()` (leaving the `with`, or `up()` failing half way) kills whatever still runs in the
namespaces and deletes them, which deletes every veth and the bridge.

`S3Cluster` is a whole cluster on such hosts (tests/slow/test_cluster_s3.py,
examples/multihost/netns_cluster.py). Needs root and iproute2:
`netns_available()` says why not. A namespace left by a killed run: `ip netns list | grep ^fmx`,
then `ip netns del NAME`.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

IP = shutil.which("ip") or "/usr/sbin/ip"
PREFIX = "fmx"
#: the subnets a network picks from: 10.231.0.0/24 .. 10.231.255.0/24
BASE = "10.231"
_LOCK = Path("/run/lock" if Path("/run/lock").is_dir() else "/tmp") / "flexmarl-netns.lock"


class NetnsError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([IP, *args], capture_output=True, text=True, timeout=60)
    if check and r.returncode:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r


def netns_available() -> str | None:
    """None when this process can build a `Network` (make a namespace, a veth and a bridge in
    it, run a command there); otherwise why not, for a test's skip."""
    if not Path(IP).exists():
        return f"no iproute2 `ip` ({IP}): install iproute2 to run hosts in network namespaces"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    name = f"{PREFIX}{secrets.token_hex(3)}-probe"
    try:
        _ip("netns", "add", name)
        try:
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb")
            _ip("-n", name, "link", "add", "name", "vbr", "type", "bridge")
            _ip("netns", "exec", name, "true")
        finally:
            _ip("netns", "del", name, check=False)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot make network namespaces here: {e}"
    return None


@dataclass(frozen=True)
class Host:
    """One namespace: its name, the `ip` of its `eth0`."""

    name: str
    ns: str
    ip: str

    def wrap(self) -> list[str]:
        """The prefix that runs a command on this host (`ip netns exec` execs it: the process
        started is the command itself, its pid the command's)."""
        return [IP, "netns", "exec", self.ns]

    def popen(self, cmd: Sequence[str], **kwargs) -> subprocess.Popen:  # noqa: ANN003 - Popen's
        return subprocess.Popen([*self.wrap(), *cmd], **kwargs)


_ROUTE_TYPES = ("unicast", "local", "broadcast", "multicast", "anycast", "unreachable", "blackhole", "prohibit",
                "throw", "nat")


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine has an address on or a route to (any table)."""
    out = []
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        m = re.search(r"\binet (\S+)", line)
        if m:
            out.append(ipaddress.ip_interface(m.group(1)).network)
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        first = (line.split() or ["default"])[0]
        if first in _ROUTE_TYPES and len(line.split()) > 1:
            first = line.split()[1]
        with contextlib.suppress(ValueError):
            if first != "default":
                out.append(ipaddress.ip_network(first, strict=False))
    return out


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    for n in random.sample(range(256), 256):
        net = ipaddress.ip_network(f"{BASE}.{n}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsError(f"no free /24 left in {BASE}.0.0/16 on this machine")


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    """Held from picking a subnet until the controller's address is on it: another run picks
    after that and sees it taken."""
    with open(_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Network:
    """Hosts `names` on a private bridge (module docstring); `up()` or `with` builds it."""

    def __init__(self, names: Sequence[str]) -> None:
        bad = [n for n in names if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,30}", n)]
        if bad or len(set(names)) != len(names) or len(names) > 250:
            raise ValueError(f"host names {list(names)}: unique, lower-case letters, digits and '-', at most 250")
        self.names = list(names)
        self.suffix = secrets.token_hex(3)
        self.switch = f"{PREFIX}{self.suffix}-switch"
        self.controller_dev = f"{PREFIX}{self.suffix}c"  # 10 characters, under the 15 allowed
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []  # namespaces made, in order

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    @property
    def controller_ip(self) -> str:
        assert self.subnet is not None, "up() the network first"
        return str(self.subnet[1])

    def __enter__(self) -> Network:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def up(self) -> Network:
        atexit.register(self.down)  # a controller that exits without down() leaves nothing
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        sw = self.switch
        self._add_ns(sw)
        _ip("-n", sw, "link", "add", "name", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        with _subnet_lock():
            self.subnet = _free_subnet()
            _ip("link", "add", "name", self.controller_dev, "type", "veth", "peer", "name", "ctl", "netns", sw)
            _ip("addr", "add", f"{self.controller_ip}/24", "dev", self.controller_dev)
        _ip("link", "set", self.controller_dev, "up")
        _ip("-n", sw, "link", "set", "ctl", "master", "br0", "up")
        for i, name in enumerate(self.names):
            ns, addr = f"{PREFIX}{self.suffix}-{name}", str(self.subnet[i + 2])
            self._add_ns(ns)
            _ip("link", "add", "name", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", sw)
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")  # the host's own processes talk over it
            self.hosts[name] = Host(name, ns, addr)

    def down(self) -> None:
        """Kill what still runs in the namespaces, delete them (their veths and the bridge go
        with them) and the controller's veth. Raises, naming them, if any is left."""
        atexit.unregister(self.down)
        for ns in self._made:
            for pid in _pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(_pids(ns) for ns in self._made) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = []
        for ns in reversed(self._made):
            r = _ip("netns", "del", ns, check=False)
            if r.returncode and Path("/run/netns", ns).exists():
                left.append(f"{ns} ({r.stderr.strip()})")
        self._made.clear()
        if Path("/sys/class/net", self.controller_dev).exists():  # its peer's namespace is gone: so is it
            _ip("link", "del", self.controller_dev, check=False)
            if Path("/sys/class/net", self.controller_dev).exists():
                left.append(self.controller_dev)
        if left:
            raise NetnsError(f"left behind: {left}")


def _pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


class Machine:
    """One process's own world on `host`: empty cwd, HOME and TMPDIR under `root/name`, and an
    environment built from scratch (PATH, LANG, HOME, TMPDIR, then `env`)."""

    def __init__(self, root: Path, name: str, host: Host, env: Mapping[str, str] | None = None) -> None:
        self.name, self.host = name, host
        self.cwd, self.home, self.tmp = (root / name / d for d in ("cwd", "home", "tmp"))
        for d in (self.cwd, self.home, self.tmp):
            d.mkdir(parents=True)
        self.env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "HOME": str(self.home),
                    "TMPDIR": str(self.tmp), **(env or {})}

    def popen(self, *cmd: str, log: str) -> subprocess.Popen:
        """`cmd` on this machine, in a process group of its own (`stop` ends the group), its
        output in HOME/`log`."""
        out = open(self.home / log, "w")  # noqa: SIM115 - the process owns it
        return self.host.popen(list(cmd), cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)

    def run(self, *cmd: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([*self.host.wrap(), *cmd], cwd=self.cwd, env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def log(self, name: str, tail: int = 3000) -> str:
        path = self.home / name
        return path.read_text(errors="replace")[-tail:] if path.exists() else f"({path} absent)"

    def files(self) -> list[Path]:
        return [p for d in (self.cwd, self.home, self.tmp) for p in d.rglob("*") if p.is_file()]


def stop(procs: Sequence[subprocess.Popen], grace_s: float = 20) -> None:
    """SIGTERM each process's group (they were started with a session of their own), SIGKILL
    what is left after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# A cluster that shares nothing but S3, every process on a host of its own.

REPO = Path(__file__).resolve().parents[1]
HOSTS = ("store", "prefect", "scheduler", "worker-a", "worker-b", "flow-1", "flow-2")
WORKERS = ("worker-a", "worker-b")
#: fixed ports: each host has its own namespace, so they never clash
MOTO_PORT, PROXY_PORT, PREFECT_PORT, SCHEDULER_PORT = 5000, 9000, 4200, 8786
#: every host runs this venv's interpreter and `dask`, as they would come from one image
DASK = str(Path(sys.executable).parent / "dask")
#: each host's certificate (`flexmarl cluster certs` makes one per role), in its HOME/tls with the CA's
ROLES = {"scheduler": "scheduler", "worker-a": "worker", "worker-b": "worker", "flow-1": "client",
         "flow-2": "client"}
#: the dask.yaml docs/cluster.md recommends for every worker (see flexmarl_core/cluster)
DASK_YAML = """distributed:
  nanny:
    pre-spawn-environ:
      MALLOC_TRIM_THRESHOLD_: null
  worker:
    profile:
      enabled: false
  scheduler:
    no-workers-timeout: 15s
"""


def _wait(ready: Callable[[], bool], what: str, timeout: float, proc: subprocess.Popen, log: Callable[[], str]) -> None:
    """Until `ready()`; an error with the end of `log()` when `proc` exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise NetnsError(f"{what} did not come up (exit {proc.poll()}): {log()}")
        time.sleep(0.2)


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


class S3Cluster:
    """The hosts `HOSTS`: "store" (moto's S3 server, and the seeded fault proxy of
    `tests._fault_proxy` in front of it when `faults` is given), "prefect" (a Prefect API server
    that demands an auth string), "scheduler" and two workers started with Dask's own command
    lines over TLS, and two flow hosts; each a `Machine` (its own cwd, HOME, TMPDIR, flexmarl
    cache, certificate), on a `Network` of its own. The workers get no PYTHONPATH (the flow
    ships the code, `cluster.upload`); the rest have this checkout's. `start()`, then `stop()`,
    which always removes everything."""

    def __init__(self, root: Path, bucket: str, *, faults: Mapping[str, float] | None = None, seed: int = 0,
                 delay_s: float = 0.2) -> None:
        self.root, self.bucket, self.faults, self.seed, self.delay_s = root, bucket, faults, seed, delay_s
        self.net = Network(HOSTS)
        self.machines: dict[str, Machine] = {}
        self.procs: list[subprocess.Popen] = []
        self.auth = secrets.token_urlsafe(24)
        self.certs = root / "controller-tls"  # this process's own set (`security()`)
        self._moto = None

    def __getitem__(self, name: str) -> Machine:
        return self.machines[name]

    def start(self) -> S3Cluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        from tests._s3 import MotoServer, make_bucket

        ip = {n: h.ip for n, h in self.net.up().hosts.items()}
        self.s3 = f"http://{ip['store']}:{MOTO_PORT}"  # moto itself: the controller's own requests
        self.s3_url = f"http://{ip['store']}:{PROXY_PORT}" if self.faults is not None else self.s3
        self.api = f"http://{ip['prefect']}:{PREFECT_PORT}/api"
        self.address = f"tls://{ip['scheduler']}:{SCHEDULER_PORT}"
        self._make_certs()
        for name in HOSTS:
            m = self.machines[name] = Machine(self.root, name, self.net[name])
            m.env.update(self._env(m))
            if name in ROLES:
                self._give_certs(m)
        m = self.machines
        # Prefect's server first: its database migrations take longest.
        prefect = m["prefect"].popen(sys.executable, "-m", "prefect", "server", "start", "--host", ip["prefect"],
                                     "--port", str(PREFECT_PORT), "--no-ui", log="server.log")
        self.procs.append(prefect)
        info = m["scheduler"].home / "scheduler.json"
        sched = m["scheduler"].popen(
            DASK, "scheduler", "--protocol", "tls", "--host", ip["scheduler"],
            "--port", str(SCHEDULER_PORT), "--no-dashboard", "--scheduler-file", str(info), *self._tls("scheduler"),
            log="scheduler.log")
        self.procs.append(sched)
        # The workers wait for the scheduler themselves; meanwhile everything starts at once.
        for w in WORKERS:
            self.procs.append(m[w].popen(
                DASK, "worker", self.address, "--host", ip[w], "--name", w,
                "--nthreads", "1", "--resources", "rollout=1,train=1", "--local-directory", str(m[w].cwd),
                *self._tls(w), log="worker.log"))
        self._moto = MotoServer(MOTO_PORT, ip["store"], wrap=self.net["store"].wrap(), env=m["store"].env)
        make_bucket(self.s3, self.bucket)
        if self.faults is not None:
            stats = m["store"].home / "faults.json"
            self.procs.append(m["store"].popen(
                sys.executable, "-m", "tests._fault_proxy", self.s3, "--listen", f"{ip['store']}:{PROXY_PORT}",
                "--seed", str(self.seed), "--rates", json.dumps(dict(self.faults)), "--delay-s", str(self.delay_s),
                "--stats", str(stats), log="fault-proxy.log"))
            _wait(stats.exists, "the fault proxy", 120, self.procs[-1], lambda: m["store"].log("fault-proxy.log"))
        _wait(info.exists, "the scheduler", 120, sched, lambda: m["scheduler"].log("scheduler.log"))
        _wait(lambda: _answers(f"{self.api}/health"), "the Prefect server", 240, prefect,
              lambda: m["prefect"].log("server.log"))
        with self.client() as c:
            c.wait_for_workers(len(WORKERS), timeout=180)

    def _env(self, m: Machine) -> dict[str, str]:
        env = {"PREFECT_HOME": str(m.home / ".prefect"), "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        if m.name == "prefect":
            from tasks.lean import server_env

            return {**env, **server_env(), "PREFECT_SERVER_API_AUTH_STRING": self.auth}
        (m.home / "dask.yaml").write_text(DASK_YAML)
        env |= {
            "PREFECT_API_URL": self.api, "PREFECT_API_AUTH_STRING": self.auth, "DASK_CONFIG": str(m.home / "dask.yaml"),
            "FLEXMARL_CACHE": str(m.home / ".cache" / "flexmarl"),
            "AWS_ENDPOINT_URL": self.s3_url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "FLEXMARL_TORCH_THREADS": "1",
        }
        return env if m.name in WORKERS else {**env, "PYTHONPATH": str(REPO)}

    def _make_certs(self) -> None:
        r = subprocess.run([sys.executable, "-m", "flexmarl.cli", "cluster", "certs", str(self.certs)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
        if r.returncode:
            raise NetnsError(f"flexmarl cluster certs failed: {(r.stdout + r.stderr)[-2000:]}")

    def _give_certs(self, m: Machine) -> None:
        """The CA's certificate and the host's role's certificate and key, copied into its HOME
        (no shared folder); `shutil.copy` keeps the key's 0600."""
        role, tls = ROLES[m.name], m.home / "tls"
        tls.mkdir(mode=0o700)
        for f in ("ca.pem", f"{role}.pem", f"{role}-key.pem"):
            shutil.copy(self.certs / f, tls / f)

    def _tls(self, name: str) -> list[str]:
        tls, role = self.machines[name].home / "tls", ROLES[name]
        return ["--tls-ca-file", str(tls / "ca.pem"), "--tls-cert", str(tls / f"{role}.pem"),
                "--tls-key", str(tls / f"{role}-key.pem")]

    def flow_sets(self) -> list[str]:
        """The flow's `--set`s for this cluster; its files named under `~`, so the config the
        run keeps on S3 names each flow host's own copy."""
        return [f"cluster.address={self.address}", "cluster.security.ca_file=~/tls/ca.pem",
                "cluster.security.cert_file=~/tls/client.pem", "cluster.security.key_file=~/tls/client-key.pem"]

    def security(self):  # noqa: ANN201 - a distributed.Security
        from distributed.security import Security

        c = self.certs
        return Security(require_encryption=True, tls_ca_file=str(c / "ca.pem"), tls_client_cert=str(c / "client.pem"),
                        tls_client_key=str(c / "client-key.pem"))

    def client(self):  # noqa: ANN201 - a distributed.Client
        """A client of the scheduler from this process (the controller), with a client certificate."""
        from distributed import Client

        return Client(self.address, security=self.security(), timeout=30)

    def injected(self) -> dict[str, int]:
        """What the fault proxy did so far: {fault: count}."""
        return json.loads((self.machines["store"].home / "faults.json").read_text())["injected"]

    def stop(self) -> None:
        """Stop every process (workers first), then take the network down; the network goes even
        when a stop fails."""
        try:
            stop(list(reversed(self.procs)))
            if self._moto is not None:
                self._moto.stop()
        finally:
            self.net.down()
