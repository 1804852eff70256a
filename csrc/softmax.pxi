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
            for r in prange(R, num_threads=nt, schedule='static'):
                k_softmax_row(xp + r * C, mp + r * C if mp != NULL else NULL, op + r * C, C)
