# cython: language_level=3
"""Lease counting for shared, read-only record buffers.

A producer hands taproute one payload buffer per batch together with a release
callback (typically "return this pinned buffer to my pool").  Every route and
destination that holds the batch holds one lease; the callback fires exactly
once, when the last lease is returned.
"""

from cpython.pyport cimport PY_SSIZE_T_MAX


class LeaseError(RuntimeError):
    """A lease was acquired after release, or released more often than acquired."""


cdef class BufferLease:
    """Holder count for one shared buffer; starts with one holder (the creator).

    ``acquire(n)`` adds holders, ``release()`` removes one.  When the count
    reaches zero the callback runs once and the lease is spent: acquiring it
    again is a bug and raises :class:`LeaseError`.  Each method runs without
    releasing the GIL, so counting is atomic across threads.
    """

    cdef Py_ssize_t _holders
    cdef object _callback
    cdef bint _released

    def __cinit__(self, callback=None):
        self._holders = 1
        self._callback = callback
        self._released = False

    cpdef void acquire(self, Py_ssize_t n=1) except *:
        if self._released:
            raise LeaseError("cannot acquire a lease on a buffer that was already released")
        if n < 0:
            raise ValueError(f"acquire count must be >= 0, got {n}")
        if n > PY_SSIZE_T_MAX - self._holders:
            raise OverflowError(f"acquiring {n} more leases overflows the holder count")
        self._holders += n

    cpdef void release(self) except *:
        if self._holders <= 0:
            raise LeaseError("buffer lease released more times than it was acquired")
        self._holders -= 1
        if self._holders == 0:
            self._released = True
            callback = self._callback
            self._callback = None
            if callback is not None:
                callback()

    @property
    def holders(self):
        """How many holders the buffer has now (0 once released)."""
        return self._holders

    @property
    def released(self):
        """True once the last holder has returned the buffer."""
        return self._released
