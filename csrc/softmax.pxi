# softmax_rows: stable, masked row softmax behind fa.softmax and fa.attention's weights.
# Each row is one pass of fa_softmax_row (max of kept entries, exp, sum, scale), rows are
# spread over threads.

def softmax_rows(const floating[:, ::1] x, int mask_kind, const uint8_t[:, ::1] mask,
                 floating[:, ::1] out, int n_threads=1):
    """out[r] = softmax(x[r]) over entries with mask[r] != 0 (mask_kind 1) or all entries
    (mask_kind 0).  Masked entries get 0; rows with no kept entry, or only -inf, are all 0."""
    cdef ptrdiff_t R = x.shape[0], C = x.shape[1], r
    if out.shape[0] != R or out.shape[1] != C:
        raise ValueError(f"softmax_rows: out has shape {(out.shape[0], out.shape[1])}, "
                         f"expected {(R, C)}")
    if mask_kind not in (0, 1):
        raise ValueError(f"softmax_rows: mask_kind must be 0 or 1, got {mask_kind}")
    if mask_kind == 1 and (mask.shape[0] != R or mask.shape[1] != C):
        raise ValueError(f"softmax_rows: mask has shape {(mask.shape[0], mask.shape[1])}, "
                         f"expected {(R, C)}")
    if R == 0 or C == 0:
        return
    cdef const floating *xp = &x[0, 0]
    cdef floating *op = &out[0, 0]
    cdef const uint8_t *mp = &mask[0, 0] if mask_kind == 1 else NULL
    # a thread per ~64k elements at least: below that the parallel region costs more than it saves
    cdef int nt = resolve_threads(n_threads, max(1, R * C // 65536))
    with nogil:
        if nt == 1:
            for r in range(R):
                k_softmax_row(xp + r * C, mp + r * C if mp != NULL else NULL, op + r * C, C)
        else:
            softmax_parallel(xp, mp, op, R, C, nt)


ctypedef struct SoftmaxJob:              # one softmax_rows call as the pool's threads see it
    const void *xp                      # const floating *
    const uint8_t *mp
    void *op                            # floating *
    ptrdiff_t R, C, rows
    fa_share share


cdef void softmax_parallel(const floating *xp, const uint8_t *mp, floating *op, ptrdiff_t R,
                           ptrdiff_t C, int nt) noexcept nogil:
    # Rows in chunks claimed from a shared counter, run by the caller and whichever pool helpers
    # are free (csrc/fa_pool.h).
    # 16 chunks per thread: few enough that claiming one costs nothing beside its rows, enough
    # for a late thread to leave little behind.  Above 16 MB, one contiguous chunk per thread:
    # a late thread's ~50 us matter little there, and finer chunks were slower (12 x 1024 x
    # 1024 float32: 32 chunks 1.06-1.13x the time of the old static prange, 2 chunks 1.005;
    # 8 x 512 x 512: 0.73-0.82 and 0.89).
    cdef ptrdiff_t n_chunks = <ptrdiff_t>nt * 16
    if <double>R * C * sizeof(floating) > 16e6:
        n_chunks = nt
    n_chunks = min(R, n_chunks)
    cdef ptrdiff_t rows = (R + n_chunks - 1) // n_chunks
    cdef SoftmaxJob job
    job.xp = xp
    job.mp = mp
    job.op = op
    job.R = R
    job.C = C
    job.rows = rows
    fa_share_init(&job.share)
    if floating is double:
        fa_pool_run(nt, softmax_job_d, &job, 1)
    else:
        fa_pool_run(nt, softmax_job_f, &job, 1)


cdef void softmax_job_body(SoftmaxJob *j, floating *dummy) noexcept nogil:
    cdef const floating *xp = <const floating *>j.xp
    cdef floating *op = <floating *>j.op
    cdef const uint8_t *mp = j.mp
    cdef ptrdiff_t C = j.C, r, r_end
    cdef ptrdiff_t it = fa_share_next(&j.share)
    while it * j.rows < j.R:
        r = it * j.rows
        r_end = min(j.R, r + j.rows)
        while r < r_end:
            k_softmax_row(xp + r * C, mp + r * C if mp != NULL else NULL, op + r * C, C)
            r = r + 1
        it = fa_share_next(&j.share)


cdef void softmax_job_f(void *ctx) noexcept nogil:
    softmax_job_body(<SoftmaxJob *>ctx, <float *>NULL)


cdef void softmax_job_d(void *ctx) noexcept nogil:
    softmax_job_body(<SoftmaxJob *>ctx, <double *>NULL)
