"""One engine step's cost as the simulator asks for it once per event: (seconds, ideal seconds) of a step of n
decodes at total context ctx plus a prefill chunk of m tokens at offset p.

`StepCost(r)` is gyre.roofline's step formula (that module's docstring states it) with the roofline's per-step
constants bound in; `StepCost(linear=f)` is an engine without a roofline, whose step takes f(n, ctx, m, p)
seconds and has no ideal part. A class, so that the hot-path build (gyre.compiled) compiles it with its
constants as C doubles; the arithmetic is the same operations in the same order either way.
With linear-attention layers each sequence in the step (the n decodes and the prefilling one) reads and writes
its state, in the attention kernel class at the weights' bandwidth share (a contiguous, unpaged read), and
their FLOPs are linear in tokens; without them those terms are exact zeros.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from gyre.roofline import EngineRoofline


class StepCost:
    __slots__ = ("linear", "dense", "routed", "miss", "kvb", "attn", "two_p", "two_h", "bw", "bk", "pk", "bw1",
                 "pk1", "fixed", "comm", "ep_comm", "fan", "two_ra", "sb", "ld", "lp")

    def __init__(self, r: EngineRoofline | None = None, linear: Callable[..., float] | None = None) -> None:
        self.linear = linear
        if r is None:
            self.dense = self.routed = self.miss = self.kvb = self.attn = self.two_p = self.two_h = 0.0
            self.bw = self.bk = self.pk = self.bw1 = self.pk1 = self.fixed = self.comm = self.ep_comm = 0.0
            self.fan = self.two_ra = self.sb = self.ld = self.lp = 0.0
            return
        self.dense, self.routed, self.miss, self.kvb, self.attn = (r._dense, r._routed, r._miss,
                                                                   r.kv_bytes_per_token, r._attn)
        self.two_p, self.two_h, self.bw, self.bk, self.pk, self.bw1, self.pk1 = (r._2p, r._2h, r._bw, r._bk, r._pk,
                                                                                 r._bw1, r._pk1)
        self.fixed, self.comm, self.ep_comm, self.fan = r._fixed, r._tp_comm, r._ep_comm, r._ep_fan
        self.two_ra = 2.0 * r.routed_active_params if r.expert_parallel else 0.0
        self.sb, self.ld, self.lp = 2.0 * r.state_bytes, r.lin_decode_flops, r.lin_prefill_flops

    def __call__(self, n: int, ctx: float, m: float = 0.0, p: float = 0.0,
                 group: float | None = None) -> tuple[float, float]:
        """(step time, its ideal part). `group`: the tokens of every expert-parallel replica in this step (None:
        `fan` x this one's)."""
        if self.linear is not None:
            return self.linear(n, ctx, m, p), 0.0
        return self._roof(n, ctx, m, p, group)

    def both(self, n: int, ctx: float, m: float = 0.0, p: float = 0.0) -> tuple[float, float]:
        """(step time, its ideal part) of this engine alone: the simulator's call."""
        if self.linear is not None:
            return self.linear(n, ctx, m, p), 0.0
        return self._roof(n, ctx, m, p, None)

    def _roof(self, n: float, ctx: float, m: float, p: float, group: float | None) -> tuple[float, float]:
        tokens = n + m
        if tokens <= 0:
            return 0.0, 0.0
        if group is None:
            big = tokens * self.fan
        else:
            big = group
        routed = self.routed
        w = self.dense + routed * (1.0 - self.miss ** big) if routed else self.dense
        if m > 0:
            sampled = n + 1
            kv = self.kvb * (ctx + p)
            st = self.sb * (n + 1)
            fa = self.attn * (ctx + m * p + 0.5 * m * m) + self.ld * n + self.lp * m
        else:
            sampled = n
            kv = self.kvb * ctx
            st = self.sb * n
            fa = self.attn * ctx + self.ld * n
        fl = self.two_p * tokens + self.two_h * sampled
        if group is not None:  # this replica's GPUs compute their experts' share of the group's tokens
            fl += self.two_ra * (group / self.fan - tokens)
        pk = self.pk
        lb, lf, ab, af = w / self.bw, fl / pk, kv / self.bk + st / self.bw, fa / pk
        t = (lb if lb > lf else lf) + (ab if ab > af else af) + self.fixed + self.comm * tokens + self.ep_comm * big
        bw1, pk1 = self.bw1, self.pk1
        lb, lf, ab, af = w / bw1, fl / pk1, (kv + st) / bw1, fa / pk1
        return t, (lb if lb > lf else lf) + (ab if ab > af else af)
