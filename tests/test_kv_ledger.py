"""The KV ledger's fused transitions (the engine's hot path) leave its books exactly as the steps they fuse do."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gyre.sim.cluster.execution import SimExecution
from gyre.sim.cluster.kv_ledger import KvLedger
from tests.simkit import spec

_tokens = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
_ctx = st.integers(min_value=0, max_value=1_000_000)


def _books(kv: KvLedger) -> tuple:
    return tuple(getattr(kv, k) for k in KvLedger.__slots__)


_FIELDS = ("resident", "holds", "ctx", "v_start", "pf_left", "reserved")  # what the ledger reads and writes


def _exec(f: dict) -> SimExecution:
    """An execution with these ledger fields (a real SimExecution: the compiled ledger takes no other type)."""
    x = SimExecution(spec(0, 0, gen=[10]))
    x.resident, x.holds, x.ctx, x.v_start = f["resident"], f["holds"], f["ctx"], f["v_start"]
    return x


def _fields(x: SimExecution) -> dict:
    return {k: getattr(x, k) for k in _FIELDS}


def _ledger(state_tokens: float, books: dict) -> KvLedger:
    kv = KvLedger(state_tokens)
    for k, v in books.items():
        setattr(kv, k, v)
    return kv


_books_st = st.fixed_dictionaries({"mem_fixed": _tokens, "kv_dec_base": _tokens, "pf_pending": _tokens,
                                   "pf_resident": _tokens, "n_dec": st.integers(1, 64), "holders": st.integers(1, 64)})
_exec_st = st.fixed_dictionaries({"resident": _ctx, "holds": st.booleans(), "ctx": st.one_of(_ctx, _tokens),
                                  "v_start": _tokens})


@given(books=_books_st, ex=_exec_st, ctx=_ctx, state=st.sampled_from([0.0, 4096.0]))
def test_end_turn_is_leave_decode_then_cache(books, ex, ctx, state):
    """end_turn(ex, ctx) writes the same counters and execution fields, to the bit, as leave_decode then cache."""
    a, b = _ledger(state, books), _ledger(state, books)
    xa, xb = _exec(ex), _exec(ex)
    a.end_turn(xa, ctx)
    b.leave_decode(xb)
    b.cache(xb, ctx)
    assert _books(a) == _books(b), f"books {_books(a)} != {_books(b)}"
    assert _fields(xa) == _fields(xb), f"execution {_fields(xa)} != {_fields(xb)}"


@given(books=_books_st, ex=_exec_st, need=_tokens, state=st.sampled_from([0.0, 4096.0]))
def test_load_prefill_is_load_then_queue_prefill(books, ex, need, state):
    """load_prefill(ex, need) writes the same counters and execution fields, to the bit, as load then
    queue_prefill."""
    a, b = _ledger(state, books), _ledger(state, books)
    xa, xb = _exec(ex), _exec(ex)
    a.load_prefill(xa, need)
    b.load(xb, need)
    b.queue_prefill(xb, need)
    assert _books(a) == _books(b), f"books {_books(a)} != {_books(b)}"
    assert _fields(xa) == _fields(xb), f"execution {_fields(xa)} != {_fields(xb)}"
