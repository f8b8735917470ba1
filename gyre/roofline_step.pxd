# Declarations for the hot-path build (gyre.compiled): the step formula's constants and arithmetic as C doubles.
cimport cython

cdef class StepCost:
    cdef public object linear
    cdef public double dense, routed, miss, kvb, attn, two_p, two_h, bw, bk, pk, bw1, pk1, fixed, comm, ep_comm
    cdef public double fan, two_ra, sb, ld, lp

    cpdef (double, double) both(self, n, double ctx, m=*, p=*)

    @cython.locals(tokens=double, big=double, routed=double, w=double, sampled=double, kv=double, st=double,
                   fa=double, fl=double, pk=double, lb=double, lf=double, ab=double, af=double, t=double,
                   bw1=double, pk1=double)
    cdef (double, double) _roof(self, double n, double ctx, double m, double p, object group)
