# cython: language_level=3
"""Lease counting for shared, read-only record buffers.

A producer hands taproute one payload buffer per batch together with a release
callback (typically "return this pinned buffer to my pool").  Every route and
destination that holds the batch holds one lease; the callback fires exactly
once, when the last lease is returned.

A batch merged from several (one payload view over their buffers) holds a
:class:`PartsLease` instead: each part of it holds only the buffers its
records lie in.
"""

from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdint cimport int32_t


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


cdef class PartsLease(BufferLease):
    """A lease over some of several buffers' leases: those the records of one
    part of a merged batch lie in (every buffer, for the merged batch itself).

    Build one with :meth:`merged` (the merged batch's) and :meth:`over` (a
    part's).  A part's lease holds nothing while it has no holder: its first
    ``acquire`` takes one hold on each of its buffers' leases, and the
    ``release`` that brings it back to zero gives each of them back once.
    So a record kept (parked for a retry, buffered for an insert) keeps its
    own buffer, not every buffer merged with it.  Releasing gives every
    lease back even when one's callback raises; the first error is raised
    after the rest went back.  Acquired again after that, it takes new holds:
    :class:`LeaseError` if one of its buffers went back meanwhile (a holder
    that acquires must do so while the batch it selected from is held).
    """

    cdef tuple _leases  # every buffer's lease of the merged batch
    cdef tuple _held  # those this lease holds while it has holders

    def __init__(self, *args, **kwargs):
        raise TypeError("use PartsLease.merged(leases) or lease.over(parts)")

    @staticmethod
    def merged(leases):
        """The lease of a batch merged from the batches whose ``leases`` these
        are, in order: one holder (the merged batch's submitter), taking over
        each lease's own (their submitters' holds: do not release those)."""
        cdef PartsLease lease = PartsLease.__new__(PartsLease)
        lease._leases = tuple(leases)
        for each in lease._leases:
            if not isinstance(each, BufferLease):
                raise TypeError(f"PartsLease.merged takes BufferLease objects, got {each!r}")
        lease._held = lease._leases
        return lease

    def over(self, const int32_t[:] parts not None):
        """The lease of a part of the merged batch whose records lie in the
        buffers ``parts`` names (per record, an index into :meth:`merged`'s
        leases): no holder yet, it holds those buffers once acquired."""
        cdef Py_ssize_t n = len(self._leases), i
        cdef int32_t part
        cdef bytearray seen = bytearray(n)
        cdef unsigned char* mark = seen
        for i in range(parts.shape[0]):
            part = parts[i]
            if part < 0 or part >= n:
                raise IndexError(f"part {part} of a lease over {n} buffers")
            mark[part] = 1
        cdef PartsLease lease = PartsLease.__new__(PartsLease)
        lease._holders = 0
        lease._leases = self._leases
        lease._held = tuple([self._leases[i] for i in range(n) if mark[i]])
        return lease

    @property
    def buffers(self):
        """How many buffers' leases this lease holds while it has holders."""
        return len(self._held)

    cpdef void acquire(self, Py_ssize_t n=1) except *:
        cdef Py_ssize_t taken = 0
        cdef BufferLease each
        if n < 0:
            raise ValueError(f"acquire count must be >= 0, got {n}")
        if n > PY_SSIZE_T_MAX - self._holders:
            raise OverflowError(f"acquiring {n} more leases overflows the holder count")
        if n == 0:
            return
        if self._holders == 0:
            try:
                for each in self._held:
                    each.acquire(1)
                    taken += 1
            except BaseException:
                for each in self._held[:taken]:
                    each.release()  # back to what it was: held by another, no callback
                raise
            self._released = False
        self._holders += n

    cpdef void release(self) except *:
        cdef BufferLease each
        if self._holders <= 0:
            raise LeaseError("buffer lease released more times than it was acquired")
        self._holders -= 1
        if self._holders:
            return
        self._released = True
        error = None
        for each in self._held:
            try:
                each.release()
            except BaseException as exc:  # the others still go back
                if error is None:
                    error = exc
        if error is not None:
            raise error
