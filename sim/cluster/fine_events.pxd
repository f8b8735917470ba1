# Declarations for the hot-path build (gyre.compiled): the fine-event loop in C.
cimport cython
from gyre.sim.cluster.time_heap cimport heappop

@cython.locals(events=long)
cpdef long run_fine(list q, object env, object ts, list deferred, list dirty, bint plain) except -1
