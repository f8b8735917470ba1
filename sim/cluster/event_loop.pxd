# Declarations for the hot-path build (gyre.compiled): the event loop in C.
cimport cython
from gyre.sim.cluster.time_heap cimport heappop, heappush

cdef object _TIMER
cdef double _INF

cdef class EventLoop:
    cdef public object now, tick, _timers
    cdef public list heap

    cpdef at(self, t, fn, arg)
    cpdef after(self, dt, fn)
    cpdef bint idle(self)
    @cython.locals(q=list, events=long, nxt=tuple)
    cpdef long run(self, list deferred, list dirty, bint plain) except -1
