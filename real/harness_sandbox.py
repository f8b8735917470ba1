"""The fence around a harness process: bubblewrap namespaces with the model proxy as the only network.

What it models: a harness runs shell commands, so the Python audit hook of gyre.real.sandbox cannot fence it.
`sandbox = "bwrap"` starts it under bubblewrap (the distribution's `bwrap`; `make install` installs it where
apt-get can) with:

- a mount namespace: /usr (and the /bin, /lib links), /etc, the Python installation, the virtual environment
  and Gyre's source read-only; its own working folder writable; a fresh /tmp, /proc and /dev; nothing else of
  the host (other executions' folders, home directories, Ray's files are not there);
- a network namespace with loopback only: inside it a forwarder (this file run as a script, the sandbox's first
  process) listens on 127.0.0.1:8000 and relays every connection to the proxy's Unix socket, bind-mounted in; so
  OPENAI_BASE_URL reaches the proxy and nothing else is reachable;
- PID, IPC, UTS and cgroup namespaces, a user namespace in which it runs as uid/gid 65534 (nobody) with no
  capabilities, a new session, and death with its parent;
- resource limits (both sandboxes): address space, file size and open files (`prlimit`, else setrlimit).

`sandbox = "none"` keeps only the limits, its own folder and process group and a clean environment. A host
without a working `bwrap` (not installed, or user namespaces disabled) is refused in one line at the task's start.

Simplifications: CPU time is bounded by the harness timeout, not by a limit; the read-only host paths are fixed
(a harness needing other tools on the host needs them under /usr).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

SANDBOXES = ("none", "bwrap")
PORT = 8000  # where the forwarder listens inside the sandbox
SOCKET = "/run/gyre/proxy.sock"  # where the proxy's socket appears inside it


class SandboxError(ValueError):
    """No sandbox of the kind asked can be had here (one line)."""


def check_sandbox(kind: str) -> None:
    """A SandboxError unless `kind` can fence a harness on this host (bwrap: installed and able to start)."""
    if kind not in SANDBOXES:
        raise SandboxError(f"HarnessTaskConfig.sandbox must be one of {SANDBOXES}, got {kind!r}")
    if kind == "none":
        return
    exe = shutil.which("bwrap")
    if exe is None:
        raise SandboxError("HarnessTaskConfig.sandbox = 'bwrap': bubblewrap is not installed (apt-get install "
                           "bubblewrap, or `make install`); sandbox = 'none' runs harnesses unfenced")
    probe = subprocess.run([exe, "--unshare-all", "--ro-bind", "/", "/", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["exit " + str(probe.returncode)])[-1]
        raise SandboxError(f"HarnessTaskConfig.sandbox = 'bwrap': bwrap cannot start here ({why}); "
                           f"sandbox = 'none' runs harnesses unfenced")


def _read_only() -> list[str]:
    gyre_root = Path(__file__).resolve().parents[1]
    paths = ["/usr", "/etc", sys.base_prefix, sys.prefix, str(gyre_root)]
    out: list[str] = []
    for p in dict.fromkeys(paths):
        if Path(p).exists():
            out += ["--ro-bind", p, p]
    for link in ("/bin", "/lib", "/lib64", "/sbin"):
        if Path(link).is_symlink():
            out += ["--symlink", os.readlink(link), link]
        elif Path(link).is_dir():
            out += ["--ro-bind", link, link]
    return out


def wrap(argv: list[str], cwd: str, env: dict, socket: str) -> tuple[list[str], dict]:
    """The bwrap command running `argv` in `cwd` fenced (see the module docstring), and its outer environment;
    `env` is the harness's environment, OPENAI_BASE_URL pointed at the forwarder."""
    inner = {**env, "OPENAI_BASE_URL": f"http://127.0.0.1:{PORT}/v1", "HOME": cwd}
    cmd = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
           "--uid", "65534", "--gid", "65534", "--cap-drop", "ALL", *_read_only(),
           "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", "/run/gyre",
           "--bind", socket, SOCKET, "--bind", cwd, cwd, "--chdir", cwd, "--clearenv"]
    for k, v in inner.items():
        cmd += ["--setenv", k, v]
    cmd += [sys.executable, "-P", str(Path(__file__).resolve()), "--", *argv]  # -P: no real/ on sys.path
    return cmd, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def limited(argv: list[str], memory_mb: int, file_mb: int, open_files: int = 256) -> tuple[list[str], object]:
    """`argv` under the harness's resource limits: through util-linux `prlimit` where it is installed (nothing runs
    in the forked child: the proxy's process has threads), else a preexec function (the second element)."""
    exe = shutil.which("prlimit")
    if exe:
        return [exe, f"--as={memory_mb << 20}", f"--fsize={file_mb << 20}", f"--nofile={open_files}", "--", *argv], None

    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))
    return argv, apply


async def _pipe(reader, writer) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _forward(argv: list[str]) -> int:
    """Inside the sandbox: relay 127.0.0.1:PORT to the proxy's socket while the harness runs; its exit code."""
    async def conn(r, w) -> None:
        try:
            ur, uw = await asyncio.open_unix_connection(SOCKET)
        except OSError:
            w.close()
            return
        await asyncio.gather(_pipe(r, uw), _pipe(ur, w))

    server = await asyncio.start_server(conn, "127.0.0.1", PORT)
    proc = await asyncio.create_subprocess_exec(*argv)
    code = await proc.wait()
    server.close()
    return code


if __name__ == "__main__":  # the forwarder: `python harness_sandbox.py -- ARGV...` inside the sandbox
    sys.exit(asyncio.run(_forward(sys.argv[sys.argv.index("--") + 1:])))
