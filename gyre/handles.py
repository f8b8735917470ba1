"""Handles: results that complete later, and processes that wait on them.

A policy is a generator that yields handles (SimPy style) and is resumed with each handle's value.
The same small machinery serves both backends: the simulator completes handles in simulated time,
the real backend when a Ray future resolves. Nothing here knows about time.

Invariants: a handle completes at most once; callbacks run in registration order, synchronously,
at the moment of completion, so the same inputs always produce the same interleaving.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import Any

_PENDING = object()


class Handle:
    """A value that becomes available later (or an error)."""

    __slots__ = ("label", "_value", "_error", "_callbacks")

    def __init__(self, label: str = "") -> None:
        self.label = label
        self._value: Any = _PENDING
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Handle], None]] = []

    @property
    def done(self) -> bool:
        return self._value is not _PENDING or self._error is not None

    @property
    def value(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._value is _PENDING:
            raise RuntimeError(f"handle {self.label!r} is not done")
        return self._value

    @property
    def error(self) -> BaseException | None:
        return self._error

    def succeed(self, value: Any = None) -> Handle:
        if self.done:
            raise RuntimeError(f"handle {self.label!r} completed twice")
        self._value = value
        self._fire()
        return self

    def fail(self, error: BaseException) -> Handle:
        if self.done:
            raise RuntimeError(f"handle {self.label!r} completed twice")
        self._error = error
        self._fire()
        return self

    def on_done(self, callback: Callable[[Handle], None]) -> None:
        if self.done:
            callback(self)
        else:
            self._callbacks.append(callback)

    def _fire(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def __repr__(self) -> str:
        state = "done" if self.done else "pending"
        return f"<Handle {self.label} {state}>"


def done_handle(value: Any = None, label: str = "") -> Handle:
    return Handle(label).succeed(value)


def all_of(handles: Iterable[Handle], label: str = "all_of") -> Handle:
    """Completes with the list of values once every handle is done (fails on the first error)."""
    handles = list(handles)
    out = Handle(label)
    remaining = [len(handles)]
    if not handles:
        return out.succeed([])

    def _one(h: Handle) -> None:
        if out.done:
            return
        if h.error is not None:
            out.fail(h.error)
            return
        remaining[0] -= 1
        if remaining[0] == 0:
            out.succeed([x.value for x in handles])

    for h in handles:
        h.on_done(_one)
    return out


def any_of(handles: Iterable[Handle], label: str = "any_of") -> Handle:
    """Completes with the first handle that is done (in completion order)."""
    handles = list(handles)
    if not handles:
        raise ValueError("any_of needs at least one handle")
    out = Handle(label)

    def _one(h: Handle) -> None:
        if not out.done:
            out.succeed(h)

    for h in handles:
        h.on_done(_one)
    return out


class Process(Handle):
    """Drives a generator that yields handles; completes with the generator's return value.

    A yielded handle that is already done resumes the generator at once (in a loop, not by
    recursion), so long chains of completed handles cannot overflow the stack.
    """

    __slots__ = ("_gen",)

    def __init__(self, gen: Generator[Handle, Any, Any], label: str = "process") -> None:
        super().__init__(label)
        if not isinstance(gen, Generator):
            raise TypeError(f"{label}: a process needs a generator, got {type(gen).__name__}")
        self._gen = gen
        self._step(None, None)

    def _resume(self, h: Handle) -> None:
        self._step(h._value, h._error)

    def _step(self, value: Any, error: BaseException | None) -> None:
        while True:
            try:
                if error is not None:
                    nxt = self._gen.throw(error)
                else:
                    nxt = self._gen.send(value)
            except StopIteration as stop:
                self.succeed(stop.value)
                return
            except BaseException as exc:  # the policy raised: the process fails with it
                self.fail(exc)
                return
            if not isinstance(nxt, Handle):
                error = TypeError(f"{self.label}: yielded {nxt!r}; a process may only yield handles")
                value = None
                continue
            if nxt.done:
                value, error = nxt._value, nxt._error
                continue
            nxt.on_done(self._resume)
            return
