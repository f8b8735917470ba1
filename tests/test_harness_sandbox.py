"""The harness fence: bubblewrap namespaces with the proxy as the only network, or a one-line refusal."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("tornado")
pytest.importorskip("transformers")

from gyre.real import harness_sandbox as hs  # noqa: E402
from gyre.real.chat import ChatTokenizer  # noqa: E402
from gyre.real.proxy_host import ProxyThread  # noqa: E402

ROOT = Path(__file__).parents[1]
PROBE = r'''
import json, os, resource, socket, urllib.request
out = {"uid": os.getuid(), "as_mb": resource.getrlimit(resource.RLIMIT_AS)[0] >> 20,
       "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
                             headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
with urllib.request.urlopen(req, timeout=20) as r:
    out["proxy"] = r.status
def reach(host, port):
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False
out["host_port"] = reach("127.0.0.1", int(os.environ["HOST_PORT"]))
out["outside"] = reach("1.1.1.1", 53)
try:
    open(os.environ["SECRET"]).read()
    out["secret"] = True
except OSError:
    out["secret"] = False
open("report.json", "w").write(json.dumps(out))
'''


def test_without_bwrap_the_sandbox_is_refused_in_one_line(monkeypatch):
    """No bwrap on PATH: a SandboxError of one line that names the field and the way out."""
    monkeypatch.setattr(hs.shutil, "which", lambda name: None)
    with pytest.raises(hs.SandboxError) as err:
        hs.check_sandbox("bwrap")
    msg = str(err.value)
    assert "HarnessTaskConfig.sandbox" in msg and "bubblewrap" in msg and "\n" not in msg, msg
    hs.check_sandbox("none")


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed (make install installs it)")
def test_a_bwrapped_harness_reaches_the_proxy_and_nothing_else(tmp_path):
    """Inside bwrap the harness runs as nobody under its limits, its call reaches the proxy through the forwarder, and
    the proxy's own TCP port, the outside network and a file beside its folder are out of reach."""
    hs.check_sandbox("bwrap")
    folder = tmp_path / "tok"
    shutil.copytree(ROOT / "configs" / "tiny_chat", folder)
    pt = ProxyThread(ChatTokenizer(folder).tok)
    try:
        secret = tmp_path / "secret.txt"
        secret.write_text("s3cret")
        cwd = tmp_path / "work" / "e0"
        cwd.mkdir(parents=True)
        (cwd / "probe.py").write_text(PROBE)
        pt.proxy.open("e0", "tok0", 8, 512)
        port = pt.url.rsplit(":", 1)[1]
        env = {"HOST_PORT": port, "SECRET": str(secret)}
        launch = pt.proxy.launch("e0", [sys.executable, "probe.py"], env, str(cwd), 60.0, "bwrap", 1536, 16)
        ev = pt.call(launch, timeout=60)
        assert ev["kind"] == "request", f"no call reached the proxy: {ev} {(cwd / '.harness.stderr').read_text()}"
        end = asyncio.run_coroutine_threadsafe(pt.proxy.respond("e0", ev["n"], [7, 0], [-1.0, -1.0]), pt.loop).result(60)
        assert end["kind"] == "exit" and end["code"] == 0, f"{end}: {(cwd / '.harness.stderr').read_text()[-500:]}"
        report = json.loads((cwd / "report.json").read_text())
        assert report == {"uid": 65534, "as_mb": 1536, "nofile": 256, "proxy": 200, "host_port": False,
                          "outside": False, "secret": False}, report
    finally:
        pt.close()
