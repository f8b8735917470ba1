"""The real backend exposes nothing it need not and loads nothing that can run code.

Listening sockets are read from the kernel (/proc/net/tcp, /proc/net/tcp6; /proc/self/fd maps them to this
process); a malicious checkpoint is a real torch.save file whose pickle would create a marker file when run.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import pickle
import socket
import struct
import threading
from pathlib import Path

import pytest

pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from gyre.real import collective as C  # noqa: E402
from gyre.real.config import preset_tiny_test  # noqa: E402
from gyre.real.trainer import CheckpointError, Trainer  # noqa: E402

CFG = preset_tiny_test()


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6}'s local address (host byte order words) as text."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    ip = socket.inet_ntop(socket.AF_INET6, words)
    return ip.removeprefix("::ffff:") if ip.startswith("::ffff:") and "." in ip else ip


def listening(own: bool = False) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of this network namespace (`own`: of this process only)."""
    mine = None
    if own:
        mine = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                mine.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or (mine is not None and f[9] not in mine):  # 0A: LISTEN
                continue
            host, port = f[1].split(":")
            out.add((_address(host), int(port, 16)))
    return out


def _interface_with_an_address() -> str | None:
    """A network interface other than loopback that has an IPv4 address (None: there is none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                addr = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
            except OSError:
                continue
            if not socket.inet_ntoa(addr).startswith("127."):
                return name
    return None


def test_proc_net_reader_sees_a_socket_where_it_listens():
    """The /proc reader finds a socket this process listens on, at its address (IPv4 and IPv6 wildcard)."""
    for family, host, want in ((socket.AF_INET, "127.0.0.1", "127.0.0.1"), (socket.AF_INET6, "::", "::")):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            s.listen()
            port = s.getsockname()[1]
            assert (want, port) in listening(own=True), f"{host}:{port} not among {listening(own=True)}"


def test_weight_sync_store_and_gloo_pairs_listen_on_loopback_in_a_local_run(monkeypatch):
    """A local run's store and its gloo groups listen on 127.0.0.1 only, even with gloo pointed at another
    interface; a group built on them works (an all-reduce sums over both members)."""
    other = _interface_with_an_address()
    if other:  # gloo's default device would be this interface: a local run must not use it
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", other)
    before = listening(own=True)
    host, port = C.serve_store(30.0, local=True)
    assert host == "127.0.0.1", f"local store served at {host}"
    comms, sums = [C.Comm(), C.Comm()], [None, None]

    def member(rank: int) -> None:
        spec = {"name": "dp1-a-b", "rank": rank, "size": 2, "store": (host, port), "backend": "gloo",
                "timeout_s": 30.0}
        t = torch.full((3,), float(rank + 1))
        C.allreduce_sum(comms[rank].group(spec), [t])
        sums[rank] = t.tolist()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sums == [[3.0] * 3, [3.0] * 3], f"all-reduce over the loopback group gave {sums}"
    new = listening(own=True) - before
    assert ("127.0.0.1", port) in new, f"store port {port} not listening on loopback: {new}"
    assert len(new) >= 2, f"the gloo pairs opened no listener of their own: {new}"
    assert {a for a, _ in new} == {"127.0.0.1"}, f"listening beyond loopback: {sorted(new)}"
    for c in comms:
        c.drop("dp1-a-b")


@pytest.mark.xdist_group("ray")
def test_pool_of_a_local_run_serves_its_store_on_loopback(local_ray):
    """The pool of a local Ray run hands out a loopback store, and nothing else listens on its port."""
    from gyre.real.pool import ActorPool

    pool = ActorPool.shared(CFG.pool)
    host, port = pool.book.store
    assert host == "127.0.0.1", f"store handed to members at {host}"
    assert {a for a, p in listening() if p == port} == {"127.0.0.1"}, f"port {port}: {sorted(listening())}"


class _Payload:
    """Pickles as a call to open(marker, "w"): unpickling it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _malicious_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """(a torch.save checkpoint of the trainer's keys whose "model" entry is the payload, its marker)."""
    marker = tmp_path / "ran"
    path = tmp_path / "ck.pt"
    torch.save({"model": _Payload(marker), "opt": {}, "version": 7,
                "model_config": dataclasses.asdict(CFG.pool.model)}, path)
    live = tmp_path / "control"
    pickle.loads(pickle.dumps(_Payload(live))).close()
    assert live.exists(), "the payload does not run when unpickled: the test would prove nothing"
    assert not marker.exists(), "torch.save ran the payload"
    return path, marker


def test_checkpoint_carrying_a_pickled_callable_is_refused_without_running_it(tmp_path):
    """Trainer.load refuses a checkpoint that needs a callable to load, names the file and the global, and the
    callable never runs (its marker file does not appear); the trainer keeps its state."""
    path, marker = _malicious_checkpoint(tmp_path)
    t = Trainer(CFG.pool.model, CFG.pool.trainer_config, seed=1)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"checkpoint {path}: refused, .*io\.open") as err:
        t.load(str(path))
    assert "\n" not in str(err.value), f"more than one line: {err.value}"
    assert not marker.exists(), "loading the checkpoint ran the pickled callable"
    assert t.version == 0 and all(torch.equal(v, t.model.state_dict()[k]) for k, v in before.items()), "state changed"


def test_cli_refuses_a_checkpoint_that_needs_code_in_one_line(tmp_path):
    """`gyre-real run` resuming from such a checkpoint: one line naming the file, exit 2, nothing run or written."""
    from typer.testing import CliRunner

    from gyre.real.cli import app

    path, marker = _malicious_checkpoint(tmp_path)
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'preset = "tiny-test"\n[cluster]\ncheckpoint = "{path}"\n')
    res = CliRunner().invoke(app, ["run", "--policy", "colocate", "--config", str(cfg), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert "\n" not in line and str(path) in line and "refused" in line, line
    assert not marker.exists(), "the CLI ran the pickled callable"
    assert not (tmp_path / "out").exists(), "outputs written for a refused checkpoint"


def test_checkpoint_round_trips_model_optimizer_and_version(tmp_path):
    """save -> load (data only) restores weights, AdamW moments and step counts, and version, bit for bit;
    a checkpoint of another model, a file that is no checkpoint, and one missing a key are one-line refusals."""
    t = Trainer(CFG.pool.model, CFG.pool.trainer_config, seed=2)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        for p in t.model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        t.opt.step()
    t.version = 5
    path = t.save(str(tmp_path / "ck.pt"))
    u = Trainer(CFG.pool.model, CFG.pool.trainer_config, seed=3)
    assert u.load(path) == 5
    for (k, a), b in zip(t.model.state_dict().items(), u.model.state_dict().values()):
        assert torch.equal(a, b), f"weight {k} differs after load"
    sa, sb = t.opt.state_dict(), u.opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"], "optimizer hyper-parameters differ"
    for i, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["state"][i][k]), f"optimizer state {i}.{k} differs after load"
    other = Trainer(dataclasses.replace(CFG.pool.model, n_layers=CFG.pool.model.n_layers + 1), seed=0)
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} is for model"):
        other.load(path)
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=rf"checkpoint {junk}: cannot be read as a torch checkpoint"):
        u.load(str(junk))
    partial = tmp_path / "partial.pt"
    torch.save({"model": t.model.state_dict(), "version": 1}, partial)
    with pytest.raises(CheckpointError, match=rf"checkpoint {partial}: not a gyre trainer checkpoint \(no opt, "):
        u.load(str(partial))
