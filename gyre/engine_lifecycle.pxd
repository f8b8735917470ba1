# Declarations for the hot-path build (gyre.compiled): EngineLifecycle as a C type, the base of the simulated engine.
cdef class EngineLifecycle:
    cdef public object state
    cdef public object _version
