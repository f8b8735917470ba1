"""A sandbox for model-written Python: run it against tests in its own process, folder and limits.

What it models: the tool of a coding task. `arun_python(code, tests, limits)` starts a fresh interpreter
(`python -I -S`, no site packages) in its own session and process group, in a new temporary folder, feeds
it a harness that fences the process in, then runs the code and each test (a statement, e.g. an assert)
and reports how many passed. The fences, in the order the harness raises them before the code runs:

- resource limits (setrlimit): CPU seconds (SIGXCPU kills it), address space, file size, open files,
  processes (counted per user: effective once it runs as `nobody`), no core files;
- no network: a new network namespace (unshare(CLONE_NEWNET): only a loopback that is down), when the
  process may create one (root, as in this project's containers); otherwise only the audit hook below;
- an unprivileged user: when started as root it drops to nobody (uid/gid 65534), owner of its folder only;
- a Python audit hook (PEP 578): opening a file for writing, or creating, renaming or removing one, outside
  its folder; any socket connect, bind or send; fork, exec, spawn, os.system; loading ctypes; each raises
  PermissionError in the model's code, which the harness reports like any other error;
- a wall-clock limit: past it the whole process group is killed (SIGKILL), children included.

The result is a dict: passed, total, status ("ok", "error" for code that does not run, "timeout" for the
wall limit, "killed" for a signal such as the CPU limit), the tail of what the code printed, and the fences
that were up. Results are read from lines tagged with a nonce the code is not given.

Simplifications: this is a fence for buggy or careless code on a trusted machine, not a security boundary
against a determined attacker (an audit hook can be evaded from C; there is no seccomp filter, no mount
namespace, no cgroup); processes of all sandboxes share the nobody user's process limit.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

NOBODY = 65534


@dataclass(kw_only=True, frozen=True)
class Limits:
    cpu_s: int = 2
    wall_s: float = 10.0
    memory_mb: int = 512
    file_mb: int = 8
    open_files: int = 64
    processes: int = 64
    output_chars: int = 2000  # the tail of the code's output kept in the result
    audit: bool = True  # the audit hook (off only to test the other fences alone)

    def __post_init__(self) -> None:
        if self.cpu_s < 1 or not self.wall_s > 0 or self.memory_mb < 64:
            raise ValueError(f"Limits: cpu_s >= 1, wall_s > 0 and memory_mb >= 64 needed, got {self}")


HARNESS = r'''
import json, os, resource, sys
nonce, cpu, mem, fsz, nofile, nproc, audit = sys.stdin.readline().split()
root = os.path.realpath(os.getcwd())
fences = ["rlimits"]
for lim, val in ((resource.RLIMIT_CPU, int(cpu)), (resource.RLIMIT_AS, int(mem)), (resource.RLIMIT_FSIZE, int(fsz)),
                 (resource.RLIMIT_NOFILE, int(nofile)), (resource.RLIMIT_NPROC, int(nproc)), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(lim, (val, val))
# what the code may import after the drop to nobody (who may not read the interpreter's own folders)
import bisect, collections, datetime, decimal, fractions, functools, heapq, itertools, math, random, re, socket
import statistics, string, time, typing
if os.geteuid() == 0:
    import ctypes
    if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) == 0:  # CLONE_NEWNET
        fences.append("netns")
    os.setgroups([]); os.setgid(%(nobody)d); os.setuid(%(nobody)d)
    fences.append("nobody")
out = os.fdopen(os.dup(1), "w")

def inside(p):
    try:
        p = os.fsdecode(p)
    except TypeError:
        return True  # a file descriptor
    full = os.path.realpath(os.path.join(root, p))
    return full == root or full.startswith(root + os.sep)

W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
NET = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
PROC = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "subprocess.Popen",
        "os.startfile", "pty.spawn"}
PATHS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod", "os.chown",
         "os.truncate", "shutil.rmtree", "shutil.move", "os.utime", "os.replace"}

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        if ((mode and any(c in mode for c in "wax+")) or (flags or 0) & W) and not inside(path):
            raise PermissionError(f"sandbox: no writes outside its folder ({path})")
    elif event in NET:
        raise PermissionError("sandbox: no network")
    elif event in PROC:
        raise PermissionError(f"sandbox: no new processes ({event})")
    elif event in PATHS:
        if not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))):
            raise PermissionError(f"sandbox: no changes outside its folder ({event})")
    elif event == "ctypes.dlopen" or (event == "import" and args[0] in ("ctypes", "_ctypes")):
        raise PermissionError("sandbox: no ctypes")

if audit == "1":
    sys.addaudithook(hook)
    fences.append("audit")
print(nonce, "fences", json.dumps(fences), file=out, flush=True)
code, tests = json.loads(sys.stdin.read())
env = {"__name__": "__main__"}
try:
    exec(compile(code, "solution.py", "exec"), env)
    print(nonce, "code", "ok", file=out, flush=True)
except BaseException as exc:
    print(nonce, "code", json.dumps(f"{type(exc).__name__}: {exc}"[:300]), file=out, flush=True)
for i, t in enumerate(tests):
    try:
        exec(compile(t, f"test{i}", "exec"), env)
        ok = "pass"
    except BaseException as exc:
        ok = json.dumps(f"{type(exc).__name__}: {exc}"[:200])
    print(nonce, "test", i, ok, file=out, flush=True)
'''.replace("%(nobody)d", str(NOBODY))


def _parse(stdout: str, nonce: str, tests: int) -> tuple[dict, str]:
    info = {"passed": 0, "fences": [], "code_error": None, "failures": []}
    rest = []
    for line in stdout.splitlines():
        head, _, tail = line.partition(" ")
        if head != nonce:
            rest.append(line)
            continue
        kind, _, val = tail.partition(" ")
        if kind == "fences":
            info["fences"] = json.loads(val)
        elif kind == "code" and val != "ok":
            info["code_error"] = json.loads(val)
        elif kind == "test":
            i, _, res = val.partition(" ")
            if res == "pass":
                info["passed"] += 1
            else:
                info["failures"].append((int(i), json.loads(res)))
    return info, "\n".join(rest)


async def arun_python(code: str, tests: list[str], limits: Limits | None = None) -> dict:
    """Run `code` then each of `tests` in the sandbox (see the module docstring)."""
    lim = limits or Limits()
    folder = tempfile.mkdtemp(prefix="gyre-sbx-")
    nonce = secrets.token_hex(16)
    t0 = time.perf_counter()
    try:
        if os.geteuid() == 0:
            os.chown(folder, NOBODY, NOBODY)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", "-c", HARNESS, cwd=folder, start_new_session=True, env={"PATH": "/usr/bin:/bin"},
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        head = (f"{nonce} {lim.cpu_s} {lim.memory_mb << 20} {lim.file_mb << 20} {lim.open_files} {lim.processes} "
                f"{int(lim.audit)}\n")
        data = head.encode() + json.dumps([code, list(tests)]).encode()
        status = "ok"
        reader = asyncio.create_task(proc.stdout.read())
        proc.stdin.write(data)
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), lim.wall_s)
        except asyncio.TimeoutError:
            status = "timeout"
        _killpg(proc.pid)  # past the wall limit, or whatever it left behind in its group
        await proc.wait()
        raw = await reader
        if status == "ok" and proc.returncode and proc.returncode < 0:
            status = "killed"
        info, rest = _parse(raw.decode("utf-8", "replace"), nonce, len(tests))
        if status == "ok" and info["code_error"]:
            status = "error"
        return {"passed": info["passed"], "total": len(tests), "status": status, "returncode": proc.returncode,
                "signal": signal.Signals(-proc.returncode).name if proc.returncode and proc.returncode < 0 else None,
                "code_error": info["code_error"], "failures": info["failures"], "fences": info["fences"],
                "output": rest[-lim.output_chars:], "wall_s": time.perf_counter() - t0}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(code: str, tests: list[str], limits: Limits | None = None) -> dict:
    """`arun_python` from synchronous code."""
    return asyncio.run(arun_python(code, tests, limits))
