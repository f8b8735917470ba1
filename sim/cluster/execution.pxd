# Declarations for the hot-path build (gyre.compiled): an execution's cursor as a C type. Attributes a log or an
# output shows as ints or floats keep their Python objects; the clock and credit fields are always floats.
cdef object _TOOL, _PREFILL, _DECODE, _QUEUED

cdef class SimExecution:
    cdef public object id, group_id, task_id, spec, engine, phase, first_version, started_at, handle, ctx
    cdef public object resident, pf_left, reserved, max_ctx, migrate_to, migrate_handle, finished_at, truncated
    cdef public object deadline_at  # compared with event times, which are Python floats
    cdef public object end, generated, ready_at, base_fv
    cdef public list gen, kv, tool_s, tool_out  # the spec's per-segment lists
    cdef public Py_ssize_t seg, last, adm, base_seg
    cdef public double v_start, seg_done, vsum, seg_cred, base_vsum
    cdef public bint holds

    cpdef wait(self)
    cpdef start_prefill(self)
    cpdef start_decode(self, double V, version)
    cpdef await_tool(self)
    cpdef end_segment(self, version)
    cpdef park(self)
    cpdef finish(self, t, str end)
    cpdef _mark_credit(self)
    cpdef credit_decoded(self, double done, version)
    cpdef drop_segment_credit(self)
