"""Standalone torch.distributed groups for gyre's actors: the gradient all-reduce and the weight broadcast.

What it models: the communication of a run whose membership keeps changing. A training step runs on the
trainer workers of whichever GPUs the policy gave it; weights go from the trainer worker of record to
whichever engines are up; a killed engine comes back as a new process. So every group is a standalone
backend (`ProcessGroupGloo` on CPU tensors, `ProcessGroupNCCL` on CUDA tensors) built on one `TCPStore`
(served by trainer worker 0, listening on loopback in a local run and on its node's cluster address
otherwise; no authentication) under a prefix unique to that group instance, and cached by name in each
member process (`Comm`). One exception: a sharded (FSDP2) trainer's step group must be the process's default
group (DTensor reads it), so `Comm.default_group` destroys and re-forms that one whenever the step's
members change.

The driver names groups by membership (`GroupBook`): the same members reuse the same group; an engine's
respawn is a new member, so it gets fresh groups, and every group that held the dead one is dropped by its
survivors at their next operation (the drop list rides on the operation's spec, in the channel the group
belongs to). Each broadcast carries a per-member sequence number and a member runs its broadcasts in that
order (`Turnstile`): the driver submits an operation to all its members at one moment, so the members'
orders are all restrictions of one global order and no two members can wait on each other in a cycle.

Weights travel in buckets of one dtype each (at most `bucket_bytes`), cut from the sender's `layout` (names,
shapes, dtypes) that rides on the spec, so a receiver allocates its buffers without knowing the model.

Simplifications: gloo's pairs listen on loopback in a local run, on gloo's default network device in a
cluster run (set GLOO_SOCKET_IFNAME on multi-homed nodes), NCCL on its own choice (NCCL_SOCKET_IFNAME); a
member that dies before a new group's rendezvous stalls the others until `timeout_s`, then the driver falls
back to the object store; NCCL cannot hold two ranks on one GPU (see `plan_broadcast`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

Layout = list[tuple[str, tuple[int, ...], str]]  # (name, shape, dtype name) in send order


@dataclass(kw_only=True, frozen=True)
class CollectiveConfig:
    """How weights and gradients travel between actors: the backend, its timeout and the bucket size."""

    backend: str = "gloo"  # "nccl" for CUDA trainers and engines
    timeout_s: float = 60.0
    bucket_mb: float = 64.0
    max_groups: int = 32  # groups the driver keeps; the least recently used is dropped past this

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"CollectiveConfig.backend must be 'gloo' or 'nccl', got {self.backend!r}")

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"


def layout_of(state: dict[str, torch.Tensor]) -> Layout:
    return [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]


def buckets(layout: Layout, bucket_bytes: int) -> list[list[int]]:
    """Consecutive runs of one dtype, each at most `bucket_bytes` (a larger tensor is a bucket of its own)."""
    out: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, shape, dt) in enumerate(layout):
        n = torch.Size(shape).numel() * getattr(torch, dt).itemsize
        if not out or dt != dtype or size + n > bucket_bytes:
            out.append([])
            size, dtype = 0, dt
        out[-1].append(i)
        size += n
    return out


def serve_store(timeout_s: float, local: bool) -> tuple[str, int]:
    """Start the master TCPStore in this process (kept for its lifetime); returns (address, port).

    It listens on one address: loopback in a `local` run (every member is on this machine), else this node's
    cluster address, the one Ray reports. torch's store server listens on every interface whatever host it is
    given, so the listening socket is made here, bound to that address, and handed to the store."""
    global _MASTER
    if local:
        host = "127.0.0.1"
    else:
        import ray

        host = ray.util.get_node_ip_address()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen()
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the socket from here
    try:
        _MASTER = TCPStore(host, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                           master_listen_fd=fd, use_libuv=True)
    except BaseException:
        os.close(fd)
        raise
    return host, port


_MASTER: TCPStore | None = None  # the store served by this process, if any (held so it stays up)


class Turnstile:
    """Runs numbered operations in number order, whichever thread gets each first."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._next = 0

    @contextmanager
    def turn(self, seq: int, timeout_s: float) -> Iterator[None]:
        with self._cv:
            if not self._cv.wait_for(lambda: self._next >= seq, timeout=timeout_s):
                missing, self._next = self._next, seq + 1  # skip the lost one rather than block every later one
                raise TimeoutError(f"collective operation {seq} waited {timeout_s}s for operation {missing}")
        try:
            yield
        finally:
            with self._cv:
                self._next = max(self._next, seq + 1)
                self._cv.notify_all()


class Comm:
    """One process's groups of one channel, by name, and the order its broadcasts run in."""

    def __init__(self) -> None:
        self.groups: dict[str, object] = {}
        self.turnstile = Turnstile()
        self._store: TCPStore | None = None
        self._store_at: tuple | None = None  # the (host, port) it is connected to
        self._lock = threading.Lock()

    def group(self, spec: dict):
        """The group of `spec` (built on first use: blocks until every member joins), after the spec's drops."""
        with self._lock:
            for name in spec.get("drop", ()):
                self.drop(name)
            pg = self.groups.get(spec["name"])
            if pg is not None:
                return pg
            store = PrefixStore(f"gyre/{spec['name']}/", self._client(spec))
            opts = _options(spec)
            if spec["backend"] == "nccl":
                from torch._C._distributed_c10d import ProcessGroupNCCL  # CUDA builds only

                pg = ProcessGroupNCCL(store, spec["rank"], spec["size"], opts)
            else:
                pg = ProcessGroupGloo(store, spec["rank"], spec["size"], opts)
            self.groups[spec["name"]] = pg
            return pg

    def default_group(self, spec: dict):
        """This process's default torch.distributed group, made afresh as the group of `spec` (FSDP2 shards
        over the default group); the previous one is destroyed. The same members may form it again and again
        (every re-shard does): each member counts itself in on the store, and the k-th forming (counts
        k*size+1 .. (k+1)*size, as each member joins one forming before it can join the next) meets under
        its own prefix."""
        import torch.distributed as dist

        with self._lock:
            for name in spec.get("drop", ()):
                self.drop(name)
            if dist.is_initialized():
                dist.destroy_process_group()
            client = self._client(spec)
            k = (client.add(f"gyre/{spec['name']}/formings", 1) - 1) // spec["size"]
            store = PrefixStore(f"gyre/{spec['name']}/{k}/", client)
            dist.init_process_group(spec["backend"], store=store, rank=spec["rank"], world_size=spec["size"],
                                    timeout=timedelta(seconds=spec["timeout_s"]), pg_options=_options(spec))
            return dist.distributed_c10d._get_default_group()

    def _client(self, spec: dict) -> TCPStore:
        """The connection to the spec's store (a new one when the store moved: the old one's groups are gone)."""
        if self._store is None or self._store_at != tuple(spec["store"]):
            for name in list(self.groups):
                self.drop(name)
            host, port = spec["store"]
            self._store = TCPStore(host, port, None, False, timedelta(seconds=spec["timeout_s"]))
            self._store_at = tuple(spec["store"])
        return self._store

    def receive_weights(self, spec: dict) -> dict[str, torch.Tensor]:
        """The state dict of the broadcast a "sync" `spec` names, received in the spec's turn (`seq`) into
        `spec["device"]` tensors; blocks until it has arrived (engines run it in a thread)."""
        with self.turnstile.turn(spec["seq"], spec["timeout_s"]):
            pg = self.group(spec)
            return receive(pg, spec["layout"], spec["bucket_bytes"], spec["device"])

    def drop(self, name: str) -> None:
        pg = self.groups.pop(name, None)
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError:
                pass  # a peer is already gone


def _options(spec: dict):
    """The options of the group of `spec`: its backend's, with the spec's timeout."""
    timeout = timedelta(seconds=spec["timeout_s"])
    if spec["backend"] == "nccl":
        from torch._C._distributed_c10d import ProcessGroupNCCL  # CUDA builds only

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return opts
    return _gloo_options(spec["store"][0], timeout)


def _gloo_options(store_host: str, timeout: timedelta) -> ProcessGroupGloo._Options:
    """A gloo group's options: its pairs listen on loopback when the store does (a local run), else on gloo's
    default device (GLOO_SOCKET_IFNAME, or the address the host name resolves to)."""
    opts = ProcessGroupGloo._Options()
    opts._timeout = timeout
    if ipaddress.ip_address(store_host).is_loopback:
        opts._devices = [ProcessGroupGloo.create_device(hostname=store_host)]
    else:
        opts._devices = [ProcessGroupGloo.create_default_device()]
    return opts


def _bcast(pg, t: torch.Tensor) -> None:
    opts = BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([t], opts).wait()


def send(pg, state: dict[str, torch.Tensor], layout: Layout, bucket_bytes: int, device: str) -> int:
    """Broadcast `state` from rank 0, bucket by bucket; returns the bytes sent."""
    sent = 0
    for idx in buckets(layout, bucket_bytes):
        flat = torch.cat([state[layout[i][0]].reshape(-1) for i in idx]).to(device)
        _bcast(pg, flat)
        sent += flat.numel() * flat.element_size()
    return sent


def receive(pg, layout: Layout, bucket_bytes: int, device: str) -> dict[str, torch.Tensor]:
    """The state dict rank 0 broadcasts (tensors are views of the received buckets)."""
    out = {}
    for idx in buckets(layout, bucket_bytes):
        sizes = [torch.Size(layout[i][1]).numel() for i in idx]
        flat = torch.empty(sum(sizes), dtype=getattr(torch, layout[idx[0]][2]), device=device)
        _bcast(pg, flat)
        for i, part in zip(idx, flat.split(sizes)):
            out[layout[i][0]] = part.view(layout[i][1])
    return out


def allreduce_sum(pg, tensors: list[torch.Tensor]) -> None:
    """Sum `tensors` (one dtype) over the group, in place, as one flat buffer."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    pg.allreduce([flat]).wait()
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def allreduce_flat(pg, flat: torch.Tensor) -> None:
    """Sum one flat tensor over the group, in place (a failed all-reduce leaves it partly summed: pass a copy)."""
    pg.allreduce([flat]).wait()


def allreduce_max(pg, t: torch.Tensor) -> None:
    """The elementwise maximum of `t` over the group, in place."""
    from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MAX
    pg.allreduce([t], opts).wait()


def plan_broadcast(source_slot: int, target_slots: list[int], backend: str) -> tuple[list[int], list[int]]:
    """(targets served by the collective, targets served by the object store).

    NCCL refuses two ranks on one device, so an engine in the sending worker's bundle (the same GPU, where
    they are colocated) takes the object store; gloo has no such limit."""
    if backend != "nccl":
        return list(target_slots), []
    return [s for s in target_slots if s != source_slot], [s for s in target_slots if s == source_slot]


class GroupBook:
    """The driver's names for groups by membership, with per-member sequence numbers and pending drops."""

    def __init__(self, store: tuple[str, int], config: CollectiveConfig, layout: Layout) -> None:
        self.store, self.cfg, self.layout = store, config, layout
        self._names: OrderedDict[tuple[str, tuple[str, ...]], str] = OrderedDict()
        self._made = 0
        self._seq: dict[str, int] = defaultdict(int)
        self._drops: dict[tuple[str, str], list[str]] = defaultdict(list)

    def specs(self, members: tuple[str, ...], channel: str) -> list[dict]:
        """One spec per member (rank = position); a broadcast's sender is members[0]."""
        key = (channel, members)
        name = self._names.get(key)
        if name is None:
            self._made += 1
            name = self._names[key] = f"{channel}{self._made}-" + "-".join(members)
            while len(self._names) > self.cfg.max_groups:
                (ch, old), old_name = self._names.popitem(last=False)
                for m in old:
                    self._drops[(ch, m)].append(old_name)
        self._names.move_to_end(key)
        out = []
        for rank, m in enumerate(members):
            spec = {"name": name, "rank": rank, "size": len(members), "store": self.store,
                    "backend": self.cfg.backend, "timeout_s": self.cfg.timeout_s,
                    "drop": self._drops.pop((channel, m), [])}
            if channel == "sync":
                spec |= {"seq": self._seq[m], "layout": self.layout, "device": self.cfg.device,
                         "bucket_bytes": int(self.cfg.bucket_mb * 2**20)}
                self._seq[m] += 1
            out.append(spec)
        return out

    def name_of(self, members: tuple[str, ...], channel: str) -> str | None:
        """The name the next `specs(members, channel)` gives (None: a group not formed yet gets a new one)."""
        return self._names.get((channel, members))

    def new_store(self, store: tuple[str, int]) -> None:
        """The store moved (its server died): every group is made afresh on the new one."""
        self.store = store
        for key in list(self._names):
            self.broken(*key)

    def forget(self, member: str) -> None:
        """`member` is gone: every group holding it is dropped by the others at their next operation."""
        for key in [k for k in self._names if member in k[1]]:
            self.broken(*key)
        self._seq.pop(member, None)

    def broken(self, channel: str, members: tuple[str, ...]) -> None:
        """The group of these members failed: its members drop it; the next use builds a fresh one."""
        name = self._names.pop((channel, members), None)
        if name is not None:
            for m in members:
                self._drops[(channel, m)].append(name)
