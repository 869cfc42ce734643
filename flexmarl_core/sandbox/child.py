"""The sandboxed child: a standalone stdlib-only script, run by source (`python -I -S -B -c`).

Two stages in two process images, so nothing the privileged stage loaded (ctypes) is left in
the candidate's image:

* ``boot`` (root or the caller's uid, in a fresh session): new network and mount namespaces,
  a private tmpfs on the world-writable folders, empty tmpfs over the hidden folders (the
  interpreter is bound back read-only), rlimits, an unprivileged uid; it reports what it could
  switch on as one frame on the result pipe, then execs the ``harness`` stage.
* ``harness`` (unprivileged): reads the candidate's code from the request pipe, installs an
  audit hook (a forbidden event ends the process with a reason), runs the code, then answers
  calls ``fn(*args)`` with the encoded return value. It never sees the tests: the parent runs
  them and compares the values, so nothing the candidate does in here can make a test pass.

The parent imports this module for the frame format and value codec (one definition).
"""

from __future__ import annotations

import json
import math
import os
import sys
import types
from typing import Any

#: exit status of a process ended by the audit hook
FORBIDDEN_EXIT = 97
#: the candidate's module name (`sys.modules`, classes' `__module__`)
CANDIDATE = "__candidate__"
#: cap on one frame (either direction): a bigger value is an error, not a parent OOM
MAX_FRAME = 1 << 20

# -- frames and values ----------------------------------------------------------------------
# A frame is a 4-byte big-endian length and a JSON object. Values are JSON with one-key tags
# for what JSON lacks, so a decoded value is always a plain builtin (never the candidate's
# object with a rigged __eq__).


def encode(v: Any) -> Any:
    t = type(v)
    if v is None or t in (bool, str):
        return v
    if t is int:
        return v if abs(v) < 1 << 53 else {"I": str(v)}
    if t is float:
        return v if math.isfinite(v) else {"X": repr(v)}
    if t is list:
        return [encode(x) for x in v]
    if t is tuple:
        return {"T": [encode(x) for x in v]}
    if t in (set, frozenset):
        return {"S" if t is set else "F": [encode(x) for x in v]}
    if t is dict:
        return {"D": [[encode(k), encode(x)] for k, x in v.items()]}
    if t is bytes:
        return {"B": v.hex()}
    if t is complex:
        return {"C": [encode(v.real), encode(v.imag)]}
    raise TypeError(f"a value of type {t.__name__} cannot be returned from the sandbox")


def decode(v: Any) -> Any:
    if v is None or type(v) in (bool, str, int, float):
        return v
    if type(v) is list:
        return [decode(x) for x in v]
    if type(v) is dict and len(v) == 1:
        (tag, x), = v.items()
        if tag == "I" and type(x) is str and len(x) <= 4000:
            return int(x)
        if tag == "X" and x in ("inf", "-inf", "nan"):
            return float(x)
        if type(x) is list:
            if tag == "T":
                return tuple(decode(e) for e in x)
            if tag in ("S", "F"):
                items = (decode(e) for e in x)
                return set(items) if tag == "S" else frozenset(items)
            if tag == "D" and all(type(p) is list and len(p) == 2 for p in x):
                return {decode(k): decode(e) for k, e in x}
            if tag == "C" and len(x) == 2:
                return complex(decode(x[0]), decode(x[1]))
        if tag == "B" and type(x) is str:
            return bytes.fromhex(x)
    raise ValueError(f"not an encoded value: {str(v)[:80]}")


def write_frame(fd: int, obj: Any) -> None:
    data = json.dumps(obj).encode()
    if len(data) > MAX_FRAME:
        data = json.dumps({"raised": f"the reply is over {MAX_FRAME} bytes"}).encode()
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def read_frame(fd: int) -> Any:
    n = int.from_bytes(_read_exact(fd, 4), "big")
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes is over {MAX_FRAME}")
    return json.loads(_read_exact(fd, n))


# -- boot stage -----------------------------------------------------------------------------

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
MS_MOVE, MS_REC, MS_PRIVATE = 8192, 16384, 1 << 18
_SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
#: folders a hidden folder must not cover (the interpreter's libraries, devices, /proc)
_SYSTEM = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/dev", "/proc", "/sys")


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def _others_can_run(python: str, prefix: str) -> bool:
    """Whether a uid with no rights of its own can exec `python` and read its `prefix`."""
    dirs = set()
    for p in (python, prefix):
        d = os.path.dirname(p)
        while d not in ("", "/"):
            dirs.add(d)
            d = os.path.dirname(d)
    try:
        return (all(os.stat(d).st_mode & 0o001 for d in dirs)
                and all(os.stat(p).st_mode & 0o005 == 0o005 for p in (python, prefix)))
    except OSError:  # a folder on the way is gone from this view: others cannot reach it either
        return False


def _boot(cfg: dict[str, Any]) -> None:
    import ctypes
    import resource

    libc = ctypes.CDLL(None, use_errno=True)
    on: dict[str, str] = {}

    def sys_ok(rc: int, what: str) -> bool:
        if rc == 0:
            return True
        on[what] = f"off: {os.strerror(ctypes.get_errno())}"
        return False

    def mount(src: str | None, dst: str, fs: str | None, flags: int, data: str | None) -> int:
        src_b, fs_b, data_b = (s.encode() if s is not None else None for s in (src, fs, data))
        return libc.mount(src_b, dst.encode(), fs_b, ctypes.c_ulong(flags), data_b)

    if sys_ok(libc.unshare(CLONE_NEWNET), "network"):
        on["network"] = "on: empty network namespace"
    mounts = sys_ok(libc.unshare(CLONE_NEWNS), "filesystem")
    if mounts:
        mounts = sys_ok(mount(None, "/", None, MS_REC | MS_PRIVATE, None), "filesystem")
    prefix = cfg["prefix"]
    if mounts:
        opts = f"size={cfg['disk_bytes']},mode=1777"
        for d in _SHARED_TMP:
            flags = MS_NOSUID | MS_NODEV
            mounts = mounts and (not os.path.isdir(d) or sys_ok(mount("tmpfs", d, "tmpfs", flags, opts), "filesystem"))
    if mounts:
        # Stash the interpreter, hide the folders, put the interpreter back read-only.
        stash = "/tmp/.interp"
        os.mkdir(stash)
        mounts = sys_ok(mount(prefix, stash, None, MS_BIND | MS_REC, None), "filesystem")
        hidden, unhidden = [], []
        for d in cfg["hide"] if mounts else ():
            if d == "/" or not os.path.isdir(d) or _under(d, _SHARED_TMP):
                continue  # "/" holds the system; the shared temp folders are private already
            if _under(d, _SYSTEM) or any(_under(s, (d,)) for s in _SYSTEM):
                unhidden.append(f"{d} (holds the system the interpreter needs)")
                continue
            if mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755") == 0:
                hidden.append(d)
            else:
                unhidden.append(f"{d} ({os.strerror(ctypes.get_errno())})")
        if mounts and not os.path.isdir(prefix):
            os.makedirs(prefix)
        mounts = mounts and sys_ok(mount(stash, prefix, None, MS_MOVE, None), "filesystem")
        mounts = mounts and sys_ok(mount(None, prefix, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None), "filesystem")
        if mounts:
            on["filesystem"] = (f"on: private tmpfs on {', '.join(_SHARED_TMP)}; hidden: "
                                f"{', '.join(hidden)}" + (f"; NOT hidden: {', '.join(unhidden)}" if unhidden else ""))
    uid = cfg["uid"]
    work = os.path.join("/tmp", f"sandbox-{uid}")
    os.mkdir(work, 0o700)
    out = os.open(os.path.join(work, "output"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    why_not = None
    if not mounts and not _others_can_run(cfg["python"], prefix):
        why_not = f"{prefix} is not readable by other users and the mount namespace is off"
    else:
        try:  # an unmapped uid (a user namespace) or no CAP_CHOWN: the switch is off
            os.chown(work, uid, uid)
            os.fchown(out, uid, uid)
        except OSError as exc:
            why_not = exc.strerror
    os.set_inheritable(out, True)  # the harness puts it on stdout/stderr once it is up
    os.chdir(work)
    lim = cfg["limits"]
    for name, value in (("RLIMIT_CPU", lim["cpu"]), ("RLIMIT_AS", lim["memory"]),
                        ("RLIMIT_NPROC", lim["processes"]), ("RLIMIT_NOFILE", lim["files"]),
                        ("RLIMIT_FSIZE", lim["output"]), ("RLIMIT_CORE", 0)):
        res = getattr(resource, name)
        hard = value + 1 if name == "RLIMIT_CPU" else value
        cap = resource.getrlimit(res)[1]
        if cap != resource.RLIM_INFINITY:  # without root a limit can only go down
            value, hard = min(value, cap), min(hard, cap)
        resource.setrlimit(res, (value, hard))
    if why_not is None:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        except OSError as exc:
            why_not = exc.strerror
    if why_not is None:
        on["user"] = f"on: uid {uid} (fresh for this program)"
    else:
        on["user"] = f"off: {why_not} (runs as uid {os.getuid()})"
    if why_not is None:
        on["processes"] = f"on: RLIMIT_NPROC={lim['processes']} (its process and threads) for its own uid"
    elif os.getuid() == 0:
        on["processes"] = "off: RLIMIT_NPROC does not bind root (the audit hook still stops fork)"
    else:
        on["processes"] = (f"partial: RLIMIT_NPROC={lim['processes']} counts every process of "
                           f"uid {os.getuid()}, and none for root outside a user namespace")
    write_frame(cfg["resp"], {"boot": on, "work": work, "private": mounts})
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work}
    os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "-c", cfg["source"], "harness",
                              str(cfg["req"]), str(cfg["resp"]), work, str(out)], env)


# -- harness stage --------------------------------------------------------------------------

_BLOCKED_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
    "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__",
    "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "gc.get_objects", "gc.get_referrers",
    "gc.get_referents", "sys.setprofile", "sys.settrace", "os.setuid", "os.putenv",
})
_BLOCKED_IMPORTS = frozenset({
    "ctypes", "_ctypes", "socket", "_socket", "ssl", "_ssl", "subprocess", "_posixsubprocess",
    "multiprocessing", "_multiprocessing", "mmap", "pty", "signal", "_signal",
})
_PATH_EVENTS = frozenset({
    "os.remove", "os.rmdir", "os.rename", "os.link", "os.symlink", "os.truncate", "os.chmod",
    "os.chown", "os.mkdir", "os.utime", "shutil.rmtree", "os.listdir", "os.scandir",
    "os.chflags", "os.lchown", "os.lchmod",
})


def _make_hook(resp: int, work: str, readable: tuple[str, ...]):  # noqa: ANN202
    """The audit hook. Everything it uses is bound here (the candidate may rebind module
    attributes later); a violation reports once and ends the process."""
    realpath, fsdecode, write, exit_ = os.path.realpath, os.fsdecode, write_frame, os._exit
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path: Any, roots: tuple[str, ...]) -> bool:
        if isinstance(path, int):
            return True
        p = realpath(fsdecode(path))
        return any(p == r or p.startswith(r + "/") for r in roots)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        why = None
        if event in _BLOCKED_EVENTS:
            why = event
        elif event == "import" and str(args[0]).split(".")[0] in _BLOCKED_IMPORTS:
            why = f"import {args[0]}"
        elif event == "open":
            path, mode, flags = args
            writes = any(c in str(mode or "") for c in "wax+") or bool((flags or 0) & write_flags)
            if not inside(path, (work, "/dev/null") if writes else (work, *readable)):
                why = f"open {fsdecode(path)!r} outside the sandbox"
        elif event in _PATH_EVENTS:
            paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
            roots = (work, *readable) if event in ("os.listdir", "os.scandir") else (work,)
            if any(not inside(p, roots) for p in paths):
                why = f"{event} outside the sandbox"
        if why is not None:
            write(resp, {"forbidden": why})
            exit_(FORBIDDEN_EXIT)

    return hook


def _harness(req: int, resp: int, work: str, out: int) -> None:
    # Until here a failure (an interpreter that cannot start under the limits) went to the
    # parent's stderr pipe; from here the program's output goes to its capped file.
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    write_frame(resp, {"ready": True})
    setup = read_frame(req)
    readable = tuple(sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}))
    sys.addaudithook(_make_hook(resp, work, (*readable, "/dev/urandom", "/dev/zero")))
    # A real module, in sys.modules while it loads and after, as `python file.py` would run
    # it: dataclasses, enums, typing and pickle look a class's module up there.
    module = types.ModuleType(CANDIDATE)
    sys.modules[CANDIDATE] = module
    namespace = module.__dict__
    try:
        exec(compile(setup["code"], "<candidate>", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - SystemExit in the code is a load error too
        write_frame(resp, {"load_error": f"{type(exc).__name__}: {exc}"[:2000]})
        return
    # Every function the code defines, so the tests can call its helpers by name (HumanEval's
    # harness runs tests in the program's namespace); the parent decides which it binds.
    defined = [k for k, v in list(namespace.items()) if isinstance(v, types.FunctionType)
               and getattr(v, "__module__", None) == CANDIDATE and isinstance(k, str)]
    write_frame(resp, {"loaded": True, "functions": defined[:1000]})
    while True:
        try:
            call = read_frame(req)
        except EOFError:
            return
        try:
            fn = namespace.get(call["fn"])
            if not callable(fn):
                raise NameError(f"the code defines no function {call['fn']!r}")
            reply = {"ok": encode(fn(*decode(call["args"])))}
        except BaseException as exc:  # noqa: BLE001 - a test that raises SystemExit fails
            try:
                reply = {"raised": f"{type(exc).__name__}: {exc}"[:2000]}
            except BaseException:  # noqa: BLE001 - str(exc) itself may raise or exhaust memory
                reply = {"raised": type(exc).__name__}
        write_frame(resp, reply)


if __name__ == "__main__":
    if sys.argv[1] == "boot":
        _boot(json.loads(sys.argv[2]))
    else:
        _harness(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
