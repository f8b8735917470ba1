# Declarations for the hot-path build (gyre.compiled): the event heaps' sifts with their keys as C doubles.
cimport cython

cpdef heappush(list heap, tuple item)
cpdef tuple heappop(list heap)
cpdef heapify(list heap)

@cython.locals(ta=double, tb=double)
cdef inline bint _less(tuple a, tuple b)
@cython.locals(item=tuple, parent=tuple, up=Py_ssize_t)
cdef void _sift_down(list heap, Py_ssize_t start, Py_ssize_t pos)
@cython.locals(end=Py_ssize_t, start=Py_ssize_t, item=tuple, child=Py_ssize_t, right=Py_ssize_t)
cdef void _sift_up(list heap, Py_ssize_t pos)
