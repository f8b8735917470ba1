# Declarations for the hot-path build (gyre.compiled): the engine's clock and plan as C doubles, its per-event
# methods as C calls on its typed parts.
cimport cython
from gyre.engine_lifecycle cimport EngineLifecycle
from gyre.roofline_step cimport StepCost
from gyre.sim.cluster.kv_ledger cimport KvLedger
from gyre.sim.cluster.kv_pressure cimport KvPressure
from gyre.sim.cluster.execution cimport SimExecution
from gyre.sim.cluster.time_heap cimport heappop, heappush

cdef double _EPS, _INF
cdef object _PREFILL, _QUEUED

cdef class SimEngine(EngineLifecycle):
    cdef public object cluster, id, gpus, costs, queue, prefill, kv_capacity, _req, _tick, _fire, _log, _seq
    cdef public object _finish, admit_limit, _budget, _reserve
    cdef public dict members
    cdef public list batch, timers, _q
    cdef public KvLedger kv
    cdef public KvPressure pressure
    cdef public StepCost _step2
    cdef public double _pf_due, V, t_last, rate, pf_rate, kv_peak, roof_s, _roof, _full
    cdef public bint paused, _dirty
    cdef public long epoch

    @cython.locals(dt=double)
    cpdef advance(self, double t)
    cpdef replan_pending(self)
    cpdef replan(self, t)
    @cython.locals(kv=KvLedger, n=Py_ssize_t, ready=list, wake=double, dec=double, used=double, pend=double,
                   tl=double, head=SimExecution, step=double, ideal=double, t_pf=double, dv=double, t_dec=double,
                   t_full=double, ep=long)
    cpdef _reschedule(self)
    cpdef touch(self, t)
    @cython.locals(kv=KvLedger, V=double, used=double, heap=list, limit=object, ex=SimExecution, seg=Py_ssize_t,
                   ready=list, n=Py_ssize_t)
    cpdef fire(self, t, epoch)
    @cython.locals(V=double, target=double)
    cpdef decode(self, SimExecution ex, t)
    @cython.locals(seg=Py_ssize_t)
    cpdef _segment_end(self, SimExecution ex, t)
    cpdef drop(self, SimExecution ex)
    cpdef leave_prefill(self, SimExecution ex)
    cpdef start_timer(self, SimExecution ex, at)
    cpdef clear(self)
