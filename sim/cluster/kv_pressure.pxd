# Declarations for the hot-path build (gyre.compiled): KV pressure as a C type over its engine's ledger.
cimport cython
from gyre.engine_lifecycle cimport EngineLifecycle
from gyre.sim.cluster.kv_ledger cimport KvLedger
from gyre.sim.cluster.execution cimport SimExecution
from gyre.sim.cluster.time_heap cimport heapify

cdef object _TOOL, _PREFILL, _DECODE, _QUEUED

cdef class KvPressure:
    cdef public EngineLifecycle engine  # its SimEngine (that module cimports this one)
    cdef public object queue, prefill, _n, _reserve, _log, _prefill_time, _gpus, _free_prefill
    cdef public KvLedger kv
    cdef public list _adm
    cdef public double full, _st, _max_seqs

    cpdef forget(self)
    @cython.locals(e=EngineLifecycle, kv=KvLedger, ex=SimExecution, n=Py_ssize_t, over=double, full=double,
                   st=double)
    cpdef start_queued(self, t)
    cpdef admitted(self, SimExecution ex)
    @cython.locals(ex=SimExecution, a=Py_ssize_t)
    cpdef _newest_holder(self)
    cpdef make_room(self, t)
    @cython.locals(kv=KvLedger, done=double)
    cpdef preempt(self, SimExecution ex, t, bint requeue=*)
    cpdef double _idle_kv(self, SimExecution keep)
    @cython.locals(ex=SimExecution)
    cpdef _evict_idle(self, double over, SimExecution keep, t)
