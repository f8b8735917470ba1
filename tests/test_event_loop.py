"""The simulator's event loop: one heap, engine events before timers at equal times, each kind in the order it
was scheduled; a plain run stops at a timer or when an event leaves work behind."""

from __future__ import annotations

import pytest

from gyre.sim.cluster.event_loop import EventLoop


def _scenario():
    loop, log = EventLoop(), []

    def engine(t, name):
        log.append((name, t, loop.now))

    def timer(name):
        return lambda: log.append((name, loop.now))

    loop.after(2.0, timer("timer-a"))
    loop.at(2.0, engine, "engine-b")  # scheduled after timer-a, runs before it (an engine event)
    loop.after(1.0, timer("timer-c"))
    loop.at(2.0, engine, "engine-d")
    loop.at(0.5, engine, "engine-e")
    loop.after(2.0, timer("timer-f"))
    return loop, log


def test_order_and_clock():
    """Time order; at t=2 both engine events (in order), then both timers (in order); the clock is each event's
    time while it runs."""
    loop, log = _scenario()
    assert loop.now == 0 and type(loop.now) is int, "the clock before any event"
    runs = []
    while not loop.idle():
        runs.append(loop.run([], [], False))
    assert log == [("engine-e", 0.5, 0.5), ("timer-c", 1.0), ("engine-b", 2.0, 2.0), ("engine-d", 2.0, 2.0),
                   ("timer-a", 2.0), ("timer-f", 2.0)], log
    assert runs == [1] * 6, "not plain: one event per run"
    assert loop.now == 2.0


def test_a_plain_run_stops_at_a_timer_and_at_left_work():
    """Plain: engine events run on until the next is a timer; a timer ends its run; so does an event that
    deferred something."""
    loop, log = _scenario()
    assert loop.run([], [], True) == 1, "engine-e, then timer-c is next"
    assert loop.run([], [], True) == 1, "timer-c ends its run"
    assert loop.run([], [], True) == 2, "engine-b and engine-d, then timer-a is next"
    deferred = []
    loop.at(3.0, lambda t, a: deferred.append(t), None)
    loop.at(4.0, lambda t, a: None, None)
    assert loop.run([], [], True) == 1 and loop.run([], [], True) == 1, "the two timers, one run each"
    assert loop.run(deferred, [], True) == 1 and deferred == [3.0], "the event at 3 left work: the run stops"
    assert loop.run([], [], True) == 1 and loop.idle()


def test_timers_at_infinity_leave_it_idle():
    """Only timers that never fire: nothing can run (a deadlock for the cluster); a negative delay is an
    error."""
    loop = EventLoop()
    assert loop.idle()
    loop.after(float("inf"), lambda: None)
    assert loop.idle() and loop.run([], [], True) == 0, "idle: a run runs nothing"
    loop.at(float("inf"), lambda t, a: None, None)
    assert not loop.idle(), "an engine event at infinity still runs (as before: nothing schedules one)"
    with pytest.raises(ValueError, match="negative delay"):
        loop.after(-1.0, lambda: None)
