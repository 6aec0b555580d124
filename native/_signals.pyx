# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Kernels of the signal processors (``taproute.service.signals``): one C pass
over a batch where numpy would run many small passes along a short axis
(8 experts per token, 4 layers per path) or build large temporaries (the
TwoNN distance matrix).

- :func:`router_stats`: per-record router statistics (softmax, entropy,
  top-k assignment counts, top-1 margin, capacity overflow) of MoE logits.
- :func:`path_codes`: each token's top-1 expert path as one int64 and each
  record's layer-to-layer transition counts.
- :func:`two_nearest`: each point's two smallest squared distances, read
  off a Gram matrix without building the distance matrix.

Each loop runs without the GIL.  Compiled without bounds checks: every entry
point checks its arguments.  NaN follows numpy: a NaN logit makes its
token's softmax figures NaN and sorts after every number in a top-k
(``argsort(-x, kind="stable")``); in an argmax the first NaN wins.
"""

import numpy as np
cimport numpy as cnp
cimport cython
from cython cimport floating
from libc.math cimport exp, log, isnan, INFINITY, NAN, floor
from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport malloc, free

cnp.import_array()

cdef extern from *:
    """
    /* max/min of two doubles as one instruction where SSE2 is there: GCC
       compiles the plain ternary to a branch in some loops, and on random
       logits a branch mispredicts on most tokens.  Same results as
       (a > b ? a : b) and (a < b ? a : b), NaN and signed zeros included. */
    #if defined(__SSE2__)
    #include <emmintrin.h>
    static inline double taproute_larger(double a, double b) {
        return _mm_cvtsd_f64(_mm_max_sd(_mm_set_sd(a), _mm_set_sd(b)));
    }
    static inline double taproute_smaller(double a, double b) {
        return _mm_cvtsd_f64(_mm_min_sd(_mm_set_sd(a), _mm_set_sd(b)));
    }
    #else
    static inline double taproute_larger(double a, double b) { return a > b ? a : b; }
    static inline double taproute_smaller(double a, double b) { return a < b ? a : b; }
    #endif
    """
    double _larger "taproute_larger"(double a, double b) noexcept nogil
    double _smaller "taproute_smaller"(double a, double b) noexcept nogil


#: router_stats takes tokens in blocks of about this many logits (128 KiB of float64).
cdef Py_ssize_t _BLOCK_VALUES = 16384


cdef inline bint _before(double a, double b) noexcept nogil:
    """``a`` ranks before ``b`` in a descending, NaN-last order (strictly)."""
    if isnan(a):
        return False
    return isnan(b) or a > b


def router_stats(const floating[:, ::1] logits, const int64_t[::1] tokens, int top_k,
                 double capacity_factor):
    """Per record of ``logits`` (``[Σ tokens, experts]``, records back to back):
    ``(counts [n, E] int64, prob_sum [n, E], entropy_sum [n], margin_sum [n],
    overflow [n] int64)``.

    Per token: softmax p of the logits (shifted by their max), entropy
    log z - Σ p x, margin p(first) - p(second) of the two largest p, and its
    top ``top_k`` experts (largest logit first, ties to the lower expert,
    NaN last), each counted once.  Overflow: Σ_e max(count_e - capacity, 0)
    with capacity floor(capacity_factor * tokens * top_k / E) per record.
    """
    cdef Py_ssize_t n = tokens.shape[0], experts = logits.shape[1]
    cdef Py_ssize_t total = 0, r, i, j, t, e, rank, best, row = 0
    for r in range(n):
        if tokens[r] < 0:
            raise ValueError(f"router_stats: record {r} has {tokens[r]} tokens")
        total += tokens[r]
    if total != logits.shape[0]:
        raise ValueError(f"router_stats: {total} tokens in the counts, {logits.shape[0]} rows")
    if not 1 <= top_k <= experts:
        raise ValueError(f"router_stats: top_k={top_k} not in 1..{experts}")
    counts_a = np.zeros((n, experts), dtype=np.int64)
    prob_a = np.zeros((n, experts), dtype=np.float64)
    entropy_a = np.zeros(n, dtype=np.float64)
    margin_a = np.zeros(n, dtype=np.float64)
    overflow_a = np.zeros(n, dtype=np.int64)
    cdef int64_t[:, ::1] counts = counts_a
    cdef double[:, ::1] prob = prob_a
    cdef double[::1] entropy = entropy_a, margin = margin_a
    cdef int64_t[::1] overflow = overflow_a
    # Tokens go in blocks: shift by the max (C), exponentiate (numpy's
    # vectorised exp, several times libm's speed), then the rest (C); the
    # block's buffers stay in cache.
    cdef Py_ssize_t block = max(1, _BLOCK_VALUES // experts), start, stop
    shifted_a = np.empty((block, experts), dtype=np.float64)
    ex_a = np.empty((block, experts), dtype=np.float64)
    cdef double[:, ::1] shifted = shifted_a
    cdef double[:, ::1] ex = ex_a
    cdef uint8_t* taken = <uint8_t*>malloc(experts)
    cdef double* top_val = <double*>malloc(top_k * sizeof(double))
    cdef Py_ssize_t* top_idx = <Py_ssize_t*>malloc(top_k * sizeof(Py_ssize_t))
    cdef Py_ssize_t held, p, i1, i2, gt1, gt2
    cdef double m, z, inv, v, s, first, second, capacity, v1, v2
    cdef bint nan
    cdef int64_t over
    cdef Py_ssize_t left = tokens[0] if n else 0
    if taken == NULL or top_val == NULL or top_idx == NULL:
        free(taken)
        free(top_val)
        free(top_idx)
        raise MemoryError()
    r = 0
    for start in range(0, total, block):
        stop = min(total, start + block)
        with nogil:
            for i in range(start, stop):
                m = logits[i, 0]
                nan = 0
                for e in range(experts):
                    v = logits[i, e]
                    nan |= v != v
                    m = _larger(m, v)
                if nan:
                    m = NAN
                for e in range(experts):
                    shifted[i - start, e] = logits[i, e] - m
        np.exp(shifted_a[: stop - start], out=ex_a[: stop - start])
        with nogil:
            for i in range(start, stop):
                while left == 0:  # the record this token belongs to
                    r += 1
                    left = tokens[r]
                left -= 1
                j = i - start
                z = 0.0
                for e in range(experts):
                    z += ex[j, e]
                inv = 1.0 / z
                s = 0.0
                first = -INFINITY
                second = -INFINITY
                nan = 0
                for e in range(experts):
                    v = ex[j, e]
                    prob[r, e] += v * inv
                    s += v * shifted[j, e]
                    nan |= v != v
                    # Branch-free top two of the exponentials (duplicates
                    # count twice; p = e / z keeps their order): random
                    # logits make an if-chain mispredict on most tokens.
                    second = _larger(second, _smaller(first, v))
                    first = _larger(first, v)
                entropy[r] += log(z) - s * inv
                margin[r] += NAN if nan else (first - second) * inv
                if nan:
                    for e in range(experts):
                        taken[e] = 0
                    for rank in range(top_k):
                        best = -1
                        for e in range(experts):
                            if not taken[e] and (best < 0 or _before(logits[i, e], logits[i, best])):
                                best = e
                        taken[best] = 1
                        counts[r, best] += 1
                elif top_k == 1:
                    # Branch-free argmax (the first largest wins).
                    v1 = logits[i, 0]
                    i1 = 0
                    for e in range(1, experts):
                        v = logits[i, e]
                        gt1 = v > v1
                        i1 = i1 + gt1 * (e - i1)
                        v1 = _larger(v, v1)
                    counts[r, i1] += 1
                elif top_k == 2:
                    # The top one or two in one branch-free pass (random
                    # logits make a branch mispredict on most tokens); a
                    # tie stays with the lower expert.
                    v1 = logits[i, 0]
                    i1 = 0
                    v2 = -INFINITY
                    i2 = -1
                    for e in range(1, experts):
                        v = logits[i, e]
                        gt1 = v > v1
                        gt2 = (v > v2) | (i2 < 0)
                        # Index selects as arithmetic, values by max/min:
                        # no branch for GCC to keep.
                        t = i2 + gt2 * (e - i2)
                        i2 = t + gt1 * (i1 - t)
                        i1 = i1 + gt1 * (e - i1)
                        v2 = _larger(v2, _smaller(v1, v))
                        v1 = _larger(v, v1)
                    counts[r, i1] += 1
                    counts[r, i2] += 1
                else:
                    # One pass keeps the top_k logits in order (largest
                    # first; a tie stays behind the lower expert).
                    held = 0
                    for e in range(experts):
                        v = logits[i, e]
                        if held == top_k:
                            if not v > top_val[top_k - 1]:
                                continue
                            p = top_k - 1
                        else:
                            p = held
                            held += 1
                        while p > 0 and top_val[p - 1] < v:
                            top_val[p] = top_val[p - 1]
                            top_idx[p] = top_idx[p - 1]
                            p -= 1
                        top_val[p] = v
                        top_idx[p] = e
                    for rank in range(top_k):
                        counts[r, top_idx[rank]] += 1
    free(taken)
    free(top_val)
    free(top_idx)
    with nogil:
        for r in range(n):
            capacity = floor(capacity_factor * tokens[r] * top_k / experts)
            over = 0
            for e in range(experts):
                if counts[r, e] > capacity:
                    over += counts[r, e] - <int64_t>capacity
            overflow[r] = over
    return counts_a, prob_a, entropy_a, margin_a, overflow_a


def path_codes(const floating[:, ::1] logits, const int64_t[::1] tokens, int layers, int experts):
    """Each token's top-1 path and each record's transitions, from router
    logits ``[Σ tokens, layers * experts]`` (layer-major, records back to back).

    Returns ``(codes [Σ tokens] int64, transitions [n, layers - 1, E, E] int64)``:
    a code holds the path's experts as base-``experts`` digits, first layer
    first; a transition cell counts tokens going from expert a at layer l to b
    at l + 1.  Top-1 is numpy's argmax: the first largest, or the first NaN.
    """
    cdef Py_ssize_t n = tokens.shape[0], total = 0, r, t, l, e, best, row = 0, prev
    cdef double v, m
    cdef int64_t code
    if layers < 1 or experts < 1 or logits.shape[1] != layers * experts:
        raise ValueError(
            f"path_codes: rows of {logits.shape[1]} values, not {layers} layers x {experts}"
        )
    for r in range(n):
        if tokens[r] < 0:
            raise ValueError(f"path_codes: record {r} has {tokens[r]} tokens")
        total += tokens[r]
    if total != logits.shape[0]:
        raise ValueError(f"path_codes: {total} tokens in the counts, {logits.shape[0]} rows")
    codes_a = np.empty(total, dtype=np.int64)
    trans_a = np.zeros((n, max(layers - 1, 0), experts, experts), dtype=np.int64)
    cdef int64_t[::1] codes = codes_a
    cdef int64_t[:, :, :, ::1] trans = trans_a
    with nogil:
        for r in range(n):
            for t in range(tokens[r]):
                code = 0
                prev = -1
                for l in range(layers):
                    best = 0
                    m = logits[row, l * experts]
                    if not isnan(m):
                        for e in range(1, experts):
                            v = logits[row, l * experts + e]
                            if isnan(v):
                                best = e
                                break
                            if v > m:
                                m = v
                                best = e
                    code = code * experts + best
                    if prev >= 0:
                        trans[r, l - 1, prev, best] += 1
                    prev = best
                codes[row] = code
                row += 1
    return codes_a, trans_a


def two_nearest(const double[:, ::1] gram, const double[::1] sq):
    """``[n, 2]``: each point's two smallest squared distances to the other
    points, d(i, j) = sq[i] + sq[j] - 2 gram[i, j] (sq: the squared norms, the
    Gram diagonal), smallest first, clipped at 0.  One pass over the Gram
    matrix; no n x n temporary.  A row with fewer than two non-NaN distances
    gets NaN.
    """
    cdef Py_ssize_t n = gram.shape[0], i, j, valid
    cdef double d, b1, b2, si
    if gram.shape[1] != n or sq.shape[0] != n:
        raise ValueError(f"two_nearest: gram {gram.shape[0]} x {gram.shape[1]}, {sq.shape[0]} norms")
    out_a = np.empty((n, 2), dtype=np.float64)
    cdef double[:, ::1] out = out_a
    with nogil:
        for i in range(n):
            b1 = INFINITY
            b2 = INFINITY
            valid = 0
            si = sq[i]
            for j in range(n):
                if j == i:
                    continue
                d = si + sq[j] - 2.0 * gram[i, j]
                if isnan(d):
                    continue
                valid += 1
                if d < b2:
                    if d < b1:
                        b2 = b1
                        b1 = d
                    else:
                        b2 = d
            if valid < 2:
                out[i, 0] = NAN
                out[i, 1] = NAN
            else:
                out[i, 0] = b1 if b1 > 0.0 else 0.0
                out[i, 1] = b2 if b2 > 0.0 else 0.0
    return out_a


def two_nearest_f32(const float[:, ::1] x, const float[:, ::1] gram, double slack):
    """``[n, 2]``: each point's two smallest squared distances to the other
    points (smallest first), as :func:`two_nearest` gives, but with the Gram
    matrix in float32 (``gram`` = x xᵀ, single-precision BLAS: half the time of
    double).

    A float32 dot product of two rows is off by at most ``slack`` x (|x_i|² +
    |x_j|²) / 2 (``slack`` >= D u / (1 - D u), D the row length, u = 2^-24), so
    each distance is known to within ``slack`` x (|x_i|² + |x_j|²).  A point's
    candidates are those whose lower bound is at most the second smallest
    upper bound; their distances are computed exactly in float64 as
    Σ (x_i - x_j)², and the two smallest kept.  Every neighbour that can be
    among the two nearest is a candidate, so the result is the float64 one
    whatever the rounding.  A row with fewer than two non-NaN distances gets
    NaN.
    """
    cdef Py_ssize_t n = x.shape[0], dims = x.shape[1], i, j, k, held, valid, diff_k
    cdef double a, spread, hi, lo, u1, u2, b1, b2, d, diff, si
    if gram.shape[0] != n or gram.shape[1] != n:
        raise ValueError(f"two_nearest_f32: gram {gram.shape[0]} x {gram.shape[1]}, {n} points")
    if not slack >= 0:
        raise ValueError(f"two_nearest_f32: slack {slack} is not >= 0")
    out_a = np.empty((n, 2), dtype=np.float64)
    sq_a = np.empty(n, dtype=np.float64)
    cdef double[:, ::1] out = out_a
    cdef double[::1] sq = sq_a
    cdef Py_ssize_t* cand = <Py_ssize_t*>malloc(max(n, 1) * sizeof(Py_ssize_t))
    cdef double* cand_lo = <double*>malloc(max(n, 1) * sizeof(double))
    if cand == NULL or cand_lo == NULL:
        free(cand)
        free(cand_lo)
        raise MemoryError()
    with nogil:
        for i in range(n):
            si = 0.0
            for k in range(dims):
                si += <double>x[i, k] * <double>x[i, k]
            sq[i] = si
        for i in range(n):
            u1 = INFINITY
            u2 = INFINITY
            held = 0
            si = sq[i]
            for j in range(n):  # one pass: U = u2 only falls, candidates filtered at the end
                if j == i:
                    continue
                a = si + sq[j] - 2.0 * <double>gram[i, j]
                spread = slack * (si + sq[j])
                lo = a - spread
                if lo <= u2:
                    cand[held] = j
                    cand_lo[held] = lo
                    held += 1
                    hi = a + spread
                    if hi < u2:
                        if hi < u1:
                            u2 = u1
                            u1 = hi
                        else:
                            u2 = hi
            b1 = INFINITY
            b2 = INFINITY
            valid = 0
            for k in range(held):
                if not cand_lo[k] <= u2:
                    continue
                j = cand[k]
                d = 0.0
                for diff_k in range(dims):
                    diff = <double>x[i, diff_k] - <double>x[j, diff_k]
                    d += diff * diff
                if isnan(d):
                    continue
                valid += 1
                if d < b2:
                    if d < b1:
                        b2 = b1
                        b1 = d
                    else:
                        b2 = d
            if valid < 2:
                out[i, 0] = NAN
                out[i, 1] = NAN
            else:
                out[i, 0] = b1
                out[i, 1] = b2
    free(cand)
    free(cand_lo)
    return out_a
