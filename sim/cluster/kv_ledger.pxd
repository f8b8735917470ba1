# Declarations for the hot-path build (gyre.compiled): the KV books as C numbers, each transition a C call.
from gyre.sim.cluster.execution cimport SimExecution

cdef class KvLedger:
    cdef public double mem_fixed, kv_dec_base, pf_pending, pf_resident, reserved, st
    cdef public Py_ssize_t n_dec, holders

    cpdef clear(self)
    cpdef double states(self)
    cpdef double used(self, double V)
    cpdef _mark(self, SimExecution ex, bint holds)
    cpdef join_decode(self, SimExecution ex, double V)
    cpdef leave_decode(self, SimExecution ex)
    cpdef end_turn(self, SimExecution ex, ctx)
    cpdef cache(self, SimExecution ex, ctx)
    cpdef shrink(self, SimExecution ex, keep)
    cpdef load(self, SimExecution ex, need)
    cpdef arrive(self, SimExecution ex, tokens)
    cpdef free(self, SimExecution ex)
    cpdef load_prefill(self, SimExecution ex, need)
    cpdef queue_prefill(self, SimExecution ex, need)
    cpdef prefill_progress(self, SimExecution head, double done)
    cpdef prefill_due(self, SimExecution head)
    cpdef unprefill(self, SimExecution ex)
    cpdef prefill_empty(self)
    cpdef reserve(self, SimExecution ex, tokens)
    cpdef unreserve(self, SimExecution ex)
