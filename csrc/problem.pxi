import sys as _sys

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_RECORDS, PyBUF_RECORDS_RO
from cpython.ref cimport PyObject

# The one C struct of a call (AttnProblem), filled once from the kernel record
# (fastattn/_backends/_kernel_args.py: KernelArgs) by fill_problem.  Every kernel family reads
# its options, arrays and tuning from here; none keeps state between calls.

# Backward: keep a block's tiles between the sweeps while they take at most this many bytes per
# thread (a band of ~18k keys in float32); longer bands recompute S and dP in sweep 2 (7 tile
# GEMMs instead of 5), so the bound caps memory (keeping was the faster of the two wherever it
# was measured: bench/results/cython_kernels.md).
cdef enum:
    BWD_KEEP_BYTES = 16 << 20


# ---- the record by position ------------------------------------------------------------------
# fill_problem reads the KernelArgs record (fastattn/_backends/_kernel_args.py) by position: a
# namedtuple's attribute lookup costs ~25 ns in CPython, and the ~30 of each call were a tenth
# of a planned tiny call (fastattn/_fastpath.py).  The cython backend checks RECORD_FIELDS
# against KernelArgs._fields when it loads (a field added or moved there must be here too).
cdef extern from "Python.h":
    bint PyTuple_Check(object o)
    Py_ssize_t PyTuple_GET_SIZE(object o)
    PyObject *PyTuple_GET_ITEM(object o, Py_ssize_t i)

cdef enum:
    RA_Q
    RA_K
    RA_V
    RA_MASK_KIND
    RA_MASK_BOOL
    RA_MASK_FLOAT
    RA_MASK_STRIDES
    RA_HAS_ALIBI
    RA_ALIBI
    RA_SCALE
    RA_SOFTCAP
    RA_Q_OFFSET
    RA_WIN_LEFT
    RA_WIN_RIGHT
    RA_DROPOUT_P
    RA_SEED
    RA_DROPOUT_BH0
    RA_DROPOUT_BH_STRIDE
    RA_DROPOUT_ROW0
    RA_DROPOUT_COL0
    RA_HAS_SINKS
    RA_SINKS
    RA_N_THREADS
    RA_HAS_DELTA
    RA_DELTA
    RA_K_STRIDES
    RA_V_STRIDES
    RA_HAS_SEQLENS
    RA_SEQLENS
    RA_HAS_BLOCK_TABLE
    RA_BLOCK_TABLE
    RA_PAGE_SIZE
    RA_KV_KIND
    RA_K_SCALE
    RA_V_SCALE
    RA_K_SCALE_STRIDES
    RA_V_SCALE_STRIDES
    RA_TUNING
    RA_N

# each enum value beside its field's name; RECORD_FIELDS, the names in enum order, is what the
# backend compares with KernelArgs._fields
_RA_OF = {
    "q": RA_Q,
    "k": RA_K,
    "v": RA_V,
    "mask_kind": RA_MASK_KIND,
    "mask_bool": RA_MASK_BOOL,
    "mask_float": RA_MASK_FLOAT,
    "mask_strides": RA_MASK_STRIDES,
    "has_alibi": RA_HAS_ALIBI,
    "alibi": RA_ALIBI,
    "scale": RA_SCALE,
    "softcap": RA_SOFTCAP,
    "q_offset": RA_Q_OFFSET,
    "win_left": RA_WIN_LEFT,
    "win_right": RA_WIN_RIGHT,
    "dropout_p": RA_DROPOUT_P,
    "seed": RA_SEED,
    "dropout_bh0": RA_DROPOUT_BH0,
    "dropout_bh_stride": RA_DROPOUT_BH_STRIDE,
    "dropout_row0": RA_DROPOUT_ROW0,
    "dropout_col0": RA_DROPOUT_COL0,
    "has_sinks": RA_HAS_SINKS,
    "sinks": RA_SINKS,
    "n_threads": RA_N_THREADS,
    "has_delta": RA_HAS_DELTA,
    "delta": RA_DELTA,
    "k_strides": RA_K_STRIDES,
    "v_strides": RA_V_STRIDES,
    "has_seqlens": RA_HAS_SEQLENS,
    "seqlens": RA_SEQLENS,
    "has_block_table": RA_HAS_BLOCK_TABLE,
    "block_table": RA_BLOCK_TABLE,
    "page_size": RA_PAGE_SIZE,
    "kv_kind": RA_KV_KIND,
    "k_scale": RA_K_SCALE,
    "v_scale": RA_V_SCALE,
    "k_scale_strides": RA_K_SCALE_STRIDES,
    "v_scale_strides": RA_V_SCALE_STRIDES,
    "tuning": RA_TUNING,
}
if sorted(_RA_OF.values()) != list(range(RA_N)):
    raise ImportError("csrc/problem.pxi: _RA_OF must name every RA_ position once")
RECORD_FIELDS = tuple(sorted(_RA_OF, key=_RA_OF.get))


cdef inline object rf(object a, Py_ssize_t i):
    """Field i of record a (fill_problem checked that a is a tuple of RA_N fields)."""
    return <object>PyTuple_GET_ITEM(a, i)


ctypedef struct Tune:                # KernelArgs.tuning, defaults applied and checked
    ptrdiff_t fwd_bq                 # forward: query rows per item (multiple of 96)
    ptrdiff_t fwd_bq_banded          #   the same under a causal/window band
    ptrdiff_t fwd_bk                 #   keys per block
    ptrdiff_t bwd_w                  # backward: query rows per block (multiple of 32, <= 96)
    ptrdiff_t bwd_bk                 #   keys per sub-block inside the band
    ptrdiff_t bwd_db                 #   keys per sub-block where the band edge cuts the block
    ptrdiff_t bwd_items_per_thread   #   split a kv head's query blocks below this
    ptrdiff_t bwd_keep_bytes         #   largest band tiles per thread kept between sweeps
    ptrdiff_t dec_bk                 # decode: keys per block
    bint dec_use_dot                 #   dot-product scores for <= 4 rows
    bint dec_bk_set                  #   dec_bk was given (not the default)
    ptrdiff_t pf_qk, pf_pv           #   keys per slice between prefetches (multiples of 12, 32)
    int dec_pf_kind                  #   -1 the kernel's choice, 0 none, 1 t0, 2 t1, 3 nta
    ptrdiff_t dec_pf_ahead           #   keys between a block and the keys prefetched during it


ctypedef struct AttnProblem:
    const char *q
    const char *k
    const char *v
    char *out
    char *lse
    const uint8_t *mask_b
    const char *mask_f
    const char *alibi
    const char *sinks                # (Hq,) T when has_sinks
    const char *delta                # (B, Hq, L) T when has_delta (backward: partial keys)
    ptrdiff_t B, Hq, Hkv, G, L, S, E, Ev
    int mask_kind
    int64_t msb, msh, msi, msj       # element strides of the active mask (0 = broadcast)
    int has_alibi
    int64_t alibi_bs                 # 0 when alibi is (1, Hq)
    int has_sinks
    int has_delta
    double scale                     # applied to each finished dot product (fa_qk epilogue)
    double softcap
    int64_t q_offset, wl, wr
    int has_dropout
    uint32_t seed, thresh
    uint32_t drop_bh0, drop_bh_stride, drop_row0, drop_col0   # hash coordinates of (b, h, i, j)
    double keep_scale                # 1 / (1 - dropout_p)
    # K/V as stored (KernelArgs k_strides ... page_size): key j of kv head hk of sequence b is
    # at k + krow + hk * ksh, krow from kv_segment (a contiguous (B, Hkv, S, E) k has strides
    # (Hkv*S*E, S*E, E), so the flash layout (B, S_max, Hkv, E) is read in place)
    int64_t ksb, ksh, kss            # element strides of k: batch (page when paged), head, key
    int64_t vsb, vsh, vss
    const int32_t *seqlens           # (B,) keys of each sequence, or NULL: S each
    const int32_t *block_table       # (B, bt_ld) pages of each sequence, or NULL: not paged
    int64_t bt_ld, page_size
    # a low-precision cache (KernelArgs kv_kind; float32 compute only): k/v hold float16 (1) or
    # bfloat16 (2) bits, or int8 codes (3) whose key j reads float32(code) * ksc[...]; their
    # element offsets (ksb ...) count stored elements.  The scales' element strides: batch or
    # page, head, position (kv_segment's row r of page pg is at pg * kcb + r * kcs).
    int kv_kind
    const float *ksc
    const float *vsc
    int64_t kcb, kch, kcs, vcb, vch, vcs
    int n_threads
    Tune tune
    # set by the kernel family before its loop
    ptrdiff_t Bk                     # keys per block
    int prefetch                     # software prefetch of K/V ahead: 0 none, else the kind
                                     # (fa_prefetch; decode streams K/V from DRAM once, the
                                     # forward re-reads them from L2)
    ptrdiff_t pf_ahead               # keys from a block's first key to the first prefetched
    ptrdiff_t Wcap                   # lane capacity of the scratch (query rows per item + slack)
    ptrdiff_t lds, ldo               # row strides of S and of the accumulator O


cdef inline int64_t seq_keys(AttnProblem *p, ptrdiff_t b) noexcept nogil:
    """The keys sequence b attends: seqlens[b], or all S."""
    return p.seqlens[b] if p.seqlens != NULL else p.S


cdef inline int64_t seq_q_offset(AttnProblem *p, ptrdiff_t b) noexcept nogil:
    """Key position of query row 0 of sequence b: the band of S keys ends where sequence b
    ends (q_offset = S - L, bottom-right, gives seqlens[b] - L)."""
    return p.q_offset + p.seqlens[b] - p.S if p.seqlens != NULL else p.q_offset


cdef inline int64_t kv_segment(AttnProblem *p, ptrdiff_t b, int64_t j, int64_t *krow,
                               int64_t *vrow) noexcept nogil:
    """Element offsets in k and v of key j of sequence b (kv head 0), and the end of the run
    of keys from j that is stored at one row stride: the end of j's page, or S."""
    cdef int64_t pg, r
    if p.block_table == NULL:
        krow[0] = b * p.ksb + j * p.kss
        vrow[0] = b * p.vsb + j * p.vss
        return p.S
    r = j % p.page_size
    pg = p.block_table[b * p.bt_ld + j // p.page_size]
    krow[0] = pg * p.ksb + r * p.kss
    vrow[0] = pg * p.vsb + r * p.vss
    return j - r + p.page_size


cdef inline uint32_t drop_row_key(AttnProblem *p, ptrdiff_t b, ptrdiff_t h,
                                  ptrdiff_t i) noexcept nogil:
    """The dropout hash's row key of query row i of head (b, h), at the call's offsets."""
    return fa_row_key(p.seed, p.drop_bh0 + <uint32_t>b * p.drop_bh_stride + <uint32_t>h,
                      p.drop_row0 + <uint32_t>i)


cdef ptrdiff_t tune_field(object t, str name, ptrdiff_t default, ptrdiff_t multiple,
                          ptrdiff_t most, ptrdiff_t unset) except -2:
    """Field `name` of the Tuning record: `unset` -> default; else a positive multiple of
    `multiple`, at most `most` (0 = no bound)."""
    cdef object x = getattr(t, name)
    if x == unset:
        return default
    if x <= 0 or x % multiple or (most and x > most):
        rule = "positive" if multiple == 1 else f"a positive multiple of {multiple}"
        if most:
            rule += f", at most {most}"
        raise ValueError(f"tuning.{name} must be {rule} ({unset} = default {default}), got {x}")
    return x


# The last Tuning record filled, and its struct: checking the 13 fields cost ~1.5 us of a
# ~10 us decode step, and a process nearly always passes the same record (the default one, or
# one `with tuning(...)` block's) call after call. Read and written with the GIL held.
cdef object _tune_seen = None
cdef Tune _tune_filled


cdef int fill_tune(Tune *t, object tuning) except -1:
    global _tune_seen, _tune_filled
    if tuning is _tune_seen:
        t[0] = _tune_filled
        return 0
    fill_tune_fields(t, tuning)
    _tune_filled = t[0]
    _tune_seen = tuning                  # a NamedTuple: immutable, so identity is enough
    return 0


cdef int fill_tune_fields(Tune *t, object tuning) except -1:
    t.fwd_bq = tune_field(tuning, "block_q", 192, 96, 0, 0)
    t.fwd_bq_banded = tune_field(tuning, "block_q_banded", 96, 96, 0, 0)
    t.fwd_bk = tune_field(tuning, "block_k", 192, 1, 0, 0)
    t.bwd_w = tune_field(tuning, "bwd_block_q", 96, 32, FA_BWD_MAXW, 0)
    t.bwd_bk = tune_field(tuning, "bwd_block_k", 96, 1, 0, 0)
    t.bwd_db = tune_field(tuning, "bwd_block_edge", 24, 1, 0, 0)
    t.bwd_items_per_thread = tune_field(tuning, "bwd_items_per_thread", 1, 1, 0, 0)
    if tuning.bwd_keep_bytes == -1:
        t.bwd_keep_bytes = BWD_KEEP_BYTES
    elif tuning.bwd_keep_bytes >= 0:
        t.bwd_keep_bytes = tuning.bwd_keep_bytes
    else:
        raise ValueError(f"tuning.bwd_keep_bytes must be >= 0 (-1 = default "
                         f"{BWD_KEEP_BYTES}), got {tuning.bwd_keep_bytes}")
    t.dec_bk = tune_field(tuning, "decode_block_k", 48, 1, 0, 0)
    t.dec_bk_set = tuning.decode_block_k != 0
    if tuning.decode_use_dot not in (-1, 0, 1):
        raise ValueError(f"tuning.decode_use_dot must be 0 or 1 (-1 = default 1), "
                         f"got {tuning.decode_use_dot}")
    t.dec_use_dot = tuning.decode_use_dot != 0
    t.pf_qk = tune_field(tuning, "prefetch_qk", 12, 12, 0, 0)
    t.pf_pv = tune_field(tuning, "prefetch_pv", 32, 32, 0, 0)
    if tuning.decode_prefetch not in (-1, 0, 1, 2, 3):
        raise ValueError(f"tuning.decode_prefetch must be 0 (off), 1 (t0), 2 (t1) or 3 (nta) "
                         f"(-1 = default), got {tuning.decode_prefetch}")
    t.dec_pf_kind = tuning.decode_prefetch
    t.dec_pf_ahead = tune_field(tuning, "decode_prefetch_ahead", 0, 1, 0, 0)
    return 0


cdef inline Py_ssize_t mv_size(Py_ssize_t *shape, int ndim) noexcept nogil:
    """Elements of a typed memoryview from its shape.  (`mv.size` builds a Python memoryview
    object and looks the attribute up: ~0.3 us each, 2-3 us of every call's entry.)"""
    cdef Py_ssize_t n = 1
    cdef int d
    for d in range(ndim):
        n *= shape[d]
    return n


cdef int64_t mask_stride(tuple shape, tuple want, tuple strides, Py_ssize_t item,
                         int d) except -2:
    """Element stride of mask dim d as the record gives it, checked against the array's own
    (a wrong one would read out of bounds)."""
    if shape[d] == 1:
        return 0
    if want[d] < 0 or want[d] * item != strides[d]:
        raise ValueError(f"attention kernel: mask strides {want} (elements) do not match the "
                         f"mask array (shape {shape}, byte strides "
                         f"{strides})")
    return want[d]


ctypedef struct ArrView:              # an array as a kernel reads it: no memoryview object
    char *data                       # NULL when the array has no element
    Py_ssize_t shape[4]
    Py_ssize_t strides[4]            # bytes


# The byte-order prefix of a native buffer format besides "@" and "=" (numpy writes "<f" for
# some native arrays); set at import from sys.byteorder.
cdef bytes _NATIVE_ORDER = b"<" if _sys.byteorder == "little" else b">"
cdef const char *_FORMAT_BYTES = b"B"      # a buffer without a format holds unsigned bytes


cdef int view_array(object obj, ArrView *v, int ndim, char *code, bint writable,
                    bint contiguous, str name) except -1:
    """v = obj's data pointer, shape and byte strides, checked: ndim dims of code[0] elements
    ('f' float, 'd' double, 'B' uint8; code[0] = 0 takes 'f' or 'd' and sets code[0] to the
    one found), C-contiguous if asked.  A typed memoryview checks the
    same but builds a Python object per array: ~1 us of a ~5 us decode call for the 5-9
    arrays of a record.  The buffer is released at once: the caller's record (or argument)
    holds the array for the whole call, so the pointer outlives the view."""
    cdef Py_buffer b
    cdef int d
    cdef Py_ssize_t want, itemsize, n = 1
    cdef const char *fmt
    cdef const char *fmt0
    PyObject_GetBuffer(obj, &b, PyBUF_RECORDS if writable else PyBUF_RECORDS_RO)
    try:
        if b.ndim != ndim:
            raise ValueError(f"attention kernel: {name} must have {ndim} dims, got {b.ndim}")
        fmt0 = fmt = <const char *>b.format if b.format != NULL else _FORMAT_BYTES
        if fmt[0] == b"@" or fmt[0] == b"=" or fmt[0] == (<const char *>_NATIVE_ORDER)[0]:
            fmt += 1
        if code[0] == 0 and (fmt[0] == b"f" or fmt[0] == b"d"):
            code[0] = fmt[0]
        itemsize = (4 if code[0] == b"f" else 8 if code[0] == b"d" else 2 if code[0] == b"H"
                    else 1)
        if fmt[0] != code[0] or fmt[1] != 0 or b.itemsize != itemsize:
            raise ValueError(f"attention kernel: {name} has elements of buffer format "
                             f"{(<bytes>fmt0).decode()!r}, "
                             f"expected " + (repr(chr(code[0])) if code[0] else "'f' or 'd'"))
        want = itemsize
        for d in range(ndim - 1, -1, -1):
            v.shape[d] = b.shape[d]
            v.strides[d] = b.strides[d]
            n *= b.shape[d]
            if contiguous and b.shape[d] > 1 and b.strides[d] != want:
                raise ValueError(f"attention kernel: {name} is not C-contiguous")
            want *= b.shape[d]
        for d in range(ndim, 4):
            v.shape[d] = 1
            v.strides[d] = 0
        v.data = <char *>b.buf if n else NULL
    finally:
        PyBuffer_Release(&b)
    return 0


cdef inline uint32_t record_uint32(object x, str name) except? 0xFFFFFFFF:
    if not (0 <= x < 4294967296):
        raise ValueError(f"attention kernel: {name}={x} is not a uint32")
    return <uint32_t>int(x)


cdef int kv_strides(Py_ssize_t *shape, object want, Py_ssize_t *strides, Py_ssize_t item,
                    int64_t *dst, str name) except -1:
    """dst[0:3] = the record's element strides of k or v (batch/page, head, key), checked
    against the array's own along every axis longer than 1 (a wrong one would read out of
    bounds).  In C, without tuples: this runs on every call."""
    cdef int d
    if len(want) != 3:
        raise ValueError(f"attention kernel: {name}_strides must be 3 ints, got {want}")
    dst[0], dst[1], dst[2] = want
    for d in range(3):
        if shape[d] > 1 and dst[d] * item != strides[d]:
            raise ValueError(f"attention kernel: {name} strides {tuple(want)} (elements) do not "
                             f"match the {name} array (shape {shape4(shape)}, byte strides "
                             f"{shape4(strides)})")
    return 0


cdef int fill_kv_layout(AttnProblem *p, object a, ptrdiff_t n_pages) except -1:
    """seqlens and the block table, checked: every length in [0, S], every page a sequence
    uses in [0, n_pages)."""
    cdef const int32_t[::1] sl
    cdef const int32_t[:, ::1] bt
    cdef ptrdiff_t b, i, n
    p.seqlens = NULL
    p.block_table = NULL
    if rf(a, RA_HAS_SEQLENS):
        sl = rf(a, RA_SEQLENS)
        if sl.shape[0] != p.B:
            raise ValueError(f"attention kernel: seqlens shape ({sl.shape[0]},), expected "
                             f"({p.B},)")
        for b in range(p.B):
            if sl[b] < 0 or sl[b] > p.S:
                raise ValueError(f"attention kernel: seqlens[{b}] = {sl[b]} outside [0, "
                                 f"{p.S}]")
        p.seqlens = &sl[0] if p.B else NULL
    if p.page_size:
        bt = rf(a, RA_BLOCK_TABLE)
        for b in range(p.B):
            n = (seq_keys(p, b) + p.page_size - 1) // p.page_size
            for i in range(n):
                if bt[b, i] < 0 or bt[b, i] >= n_pages:
                    raise ValueError(f"attention kernel: block_table[{b}, {i}] = {bt[b, i]} "
                                     f"is not a page in [0, {n_pages})")
        p.block_table = &bt[0, 0] if bt.shape[0] * bt.shape[1] else NULL
    return 0


cdef int require_dense_kv(AttnProblem *p, str kernel) except -1:
    """For a kernel family that reads K/V only as (B, Hkv, S, E), C-contiguous, S keys each."""
    if (p.seqlens != NULL or p.page_size or p.ksb != p.Hkv * p.S * p.E or p.ksh != p.S * p.E
            or p.kss != p.E or p.vsb != p.Hkv * p.S * p.Ev or p.vsh != p.S * p.Ev
            or p.vss != p.Ev):
        raise ValueError(f"attention kernel: {kernel} does not read a KV cache in place "
                         "(strided k/v, seqlens or a block table)")
    return 0


cdef int fill_problem(AttnProblem *p, object a, floating *dummy, Py_ssize_t *outs,
                      Py_ssize_t *lses) except -1:
    """Check the record (make_problem guarantees it; this is the safety net against a
    segfault) and fill p from it.  outs/lses: shapes of the out/lse arrays of the call.
    Absent masks, slopes, sinks and delta (their flags off) are not looked at: their pointers are
    NULL, and every read of them is behind its flag."""
    if not PyTuple_Check(a) or PyTuple_GET_SIZE(a) != RA_N:
        raise TypeError(f"attention kernel: the record must be a KernelArgs ({RA_N} fields), "
                        f"got {type(a).__name__}")
    cdef char code = b"f" if floating is float else b"d"
    cdef char code_b = b"B"
    cdef Py_ssize_t item = sizeof(floating), item_m
    cdef int d
    cdef ArrView q, k, v, m, ks, vs
    view_array(rf(a, RA_Q), &q, 4, &code, False, True, "q")
    # k/v: any strides but a contiguous last axis (a KV cache read in place; checked below),
    # of the compute dtype or as a low-precision cache stores them
    cdef int kv_kind = rf(a, RA_KV_KIND)
    cdef char kv_code = code
    cdef Py_ssize_t kv_item = item
    if kv_kind:
        if floating is double or kv_kind not in (1, 2, 3):
            raise ValueError(f"attention kernel: kv_kind {kv_kind} must be 0, or 1-3 with "
                             f"float32 q/out")
        kv_code = b"H" if kv_kind != 3 else b"b"
        kv_item = 2 if kv_kind != 3 else 1
    view_array(rf(a, RA_K), &k, 4, &kv_code, False, False, "k")
    view_array(rf(a, RA_V), &v, 4, &kv_code, False, False, "v")
    cdef ptrdiff_t B = q.shape[0], Hq = q.shape[1], L = q.shape[2], E = q.shape[3]
    cdef ptrdiff_t Hkv = k.shape[1], S = k.shape[2], Ev = v.shape[3]
    # paged: k/v are (num_pages, Hkv, page_size, E) and S = max_pages * page_size
    cdef bint paged = rf(a, RA_HAS_BLOCK_TABLE)
    cdef ptrdiff_t page_size = rf(a, RA_PAGE_SIZE) if paged else 0
    cdef object bt = rf(a, RA_BLOCK_TABLE)
    cdef tuple bts = (bt.shape[0], bt.shape[1]) if paged else (0, 0)
    if (v.shape[0] != k.shape[0] or v.shape[1] != Hkv or v.shape[2] != S or k.shape[3] != E
            or (k.shape[2] != page_size or bts[0] != B if paged else k.shape[0] != B)):
        raise ValueError(f"attention kernel: q {shape4(q.shape)}, k {shape4(k.shape)}, "
                         f"v {shape4(v.shape)}"
                         + (f", block_table {bts}, page_size {page_size}" if paged else "")
                         + " do not agree")
    if paged and page_size <= 0:
        raise ValueError(f"attention kernel: page_size {page_size} must be > 0")
    if paged:
        S = bts[1] * page_size
    if E > 1 and k.strides[3] != kv_item or Ev > 1 and v.strides[3] != kv_item:
        raise ValueError(f"attention kernel: the last axis of k and v must be contiguous, got "
                         f"byte strides {shape4(k.strides)} and {shape4(v.strides)}")
    cdef int64_t kst[3]
    cdef int64_t vst[3]
    kv_strides(k.shape, rf(a, RA_K_STRIDES), k.strides, kv_item, kst, "k")
    kv_strides(v.shape, rf(a, RA_V_STRIDES), v.strides, kv_item, vst, "v")
    cdef int64_t kcst[3]
    cdef int64_t vcst[3]
    cdef char code_f = b"f"
    p.ksc = p.vsc = NULL
    kcst[0] = kcst[1] = kcst[2] = vcst[0] = vcst[1] = vcst[2] = 0
    if kv_kind == 3:
        # the scales cover k's first three axes exactly, so every key read has its scale
        view_array(rf(a, RA_K_SCALE), &ks, 3, &code_f, False, False, "k_scale")
        view_array(rf(a, RA_V_SCALE), &vs, 3, &code_f, False, False, "v_scale")
        for d in range(3):
            if ks.shape[d] != k.shape[d] or vs.shape[d] != v.shape[d]:
                raise ValueError(f"attention kernel: k_scale {shape4(ks.shape)[:3]} / v_scale "
                                 f"{shape4(vs.shape)[:3]} must match the first three axes of "
                                 f"k {shape4(k.shape)} / v {shape4(v.shape)}")
        kv_strides(ks.shape, rf(a, RA_K_SCALE_STRIDES), ks.strides, 4, kcst, "k_scale")
        kv_strides(vs.shape, rf(a, RA_V_SCALE_STRIDES), vs.strides, 4, vcst, "v_scale")
        p.ksc = <const float *>ks.data
        p.vsc = <const float *>vs.data
    if Hkv == 0 and Hq != 0 or Hkv != 0 and Hq % Hkv != 0:
        raise ValueError(f"attention kernel: Hq={Hq} is not a multiple of Hkv={Hkv}")
    if (outs[0] != B or outs[1] != Hq or outs[2] != L or outs[3] != Ev
            or lses[0] != B or lses[1] != Hq or lses[2] != L):
        raise ValueError(f"attention kernel: out {shape4(outs)} / lse "
                         f"{(lses[0], lses[1], lses[2])} do not match "
                         f"{(B, Hq, L, Ev)} / {(B, Hq, L)}")
    cdef int mask_kind = rf(a, RA_MASK_KIND)
    if mask_kind not in (0, 1, 2):
        raise ValueError(f"attention kernel: mask_kind must be 0, 1 or 2, got {mask_kind}")
    cdef tuple ms, full, want, mstrides
    p.msb = p.msh = p.msi = p.msj = 0
    p.mask_b = NULL
    p.mask_f = NULL
    if mask_kind:
        if mask_kind == 1:
            view_array(rf(a, RA_MASK_BOOL), &m, 4, &code_b, False, False, "mask_bool")
            p.mask_b = <const uint8_t *>m.data
        else:
            view_array(rf(a, RA_MASK_FLOAT), &m, 4, &code, False, False, "mask_float")
            p.mask_f = <const char *>m.data
        ms = shape4(m.shape)
        full = (B, Hq, L, S)
        want = tuple(rf(a, RA_MASK_STRIDES))
        mstrides = shape4(m.strides)
        for d in range(4):
            if ms[d] != 1 and ms[d] != full[d]:
                raise ValueError(f"attention kernel: mask shape {ms} does not broadcast "
                                 f"to {full}")
        item_m = 1 if mask_kind == 1 else item
        p.msb = mask_stride(ms, want, mstrides, item_m, 0)
        p.msh = mask_stride(ms, want, mstrides, item_m, 1)
        p.msi = mask_stride(ms, want, mstrides, item_m, 2)
        p.msj = mask_stride(ms, want, mstrides, item_m, 3)
    cdef bint has_alibi = rf(a, RA_HAS_ALIBI)
    p.alibi = NULL
    p.alibi_bs = 0
    if has_alibi:
        view_array(rf(a, RA_ALIBI), &m, 2, &code, False, True, "alibi")
        if m.shape[1] != Hq or m.shape[0] not in (1, B):
            raise ValueError(f"attention kernel: alibi shape {(m.shape[0], m.shape[1])}, "
                             f"expected (1 or {B}, {Hq})")
        p.alibi = <const char *>m.data
        p.alibi_bs = Hq if m.shape[0] != 1 else 0
    cdef bint has_sinks = rf(a, RA_HAS_SINKS)
    p.sinks = NULL
    if has_sinks:
        view_array(rf(a, RA_SINKS), &m, 1, &code, False, True, "sinks")
        if m.shape[0] != Hq:
            raise ValueError(f"attention kernel: sinks shape ({m.shape[0]},), expected ({Hq},)")
        p.sinks = <const char *>m.data
    cdef bint has_delta = rf(a, RA_HAS_DELTA)
    p.delta = NULL
    if has_delta:
        view_array(rf(a, RA_DELTA), &m, 3, &code, False, True, "delta")
        if (m.shape[0], m.shape[1], m.shape[2]) != (B, Hq, L):
            raise ValueError(f"attention kernel: delta shape {(m.shape[0], m.shape[1], m.shape[2])}"
                             f", expected {(B, Hq, L)}")
        p.delta = <const char *>m.data
    cdef double dropout_p = rf(a, RA_DROPOUT_P)
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"attention kernel: dropout_p={dropout_p} outside [0, 1)")
    cdef int64_t win_left = rf(a, RA_WIN_LEFT), win_right = rf(a, RA_WIN_RIGHT)
    if win_left < 0 or win_right < 0:
        raise ValueError("attention kernel: window sides must be >= 0")
    p.seed = record_uint32(rf(a, RA_SEED), "seed")
    p.drop_bh0 = record_uint32(rf(a, RA_DROPOUT_BH0), "dropout_bh0")
    p.drop_bh_stride = record_uint32(rf(a, RA_DROPOUT_BH_STRIDE), "dropout_bh_stride")
    p.drop_row0 = record_uint32(rf(a, RA_DROPOUT_ROW0), "dropout_row0")
    p.drop_col0 = record_uint32(rf(a, RA_DROPOUT_COL0), "dropout_col0")
    fill_tune(&p.tune, rf(a, RA_TUNING))
    p.B, p.Hq, p.Hkv, p.L, p.S, p.E, p.Ev = B, Hq, Hkv, L, S, E, Ev
    p.G = Hq // Hkv if Hkv else 1
    p.mask_kind = mask_kind
    p.has_alibi = has_alibi
    p.has_sinks = has_sinks
    p.has_delta = has_delta
    p.scale = rf(a, RA_SCALE)
    cdef double softcap = rf(a, RA_SOFTCAP)
    p.softcap = softcap if softcap > 0 else 0.0
    p.q_offset = rf(a, RA_Q_OFFSET)
    # an "unbounded" side arrives as L + S + 1; clamp so pos +- w can never overflow int64
    p.wl = min(win_left, L + S + 1)
    p.wr = min(win_right, L + S + 1)
    p.has_dropout = dropout_p > 0
    p.thresh = <uint32_t>min(<double>(dropout_p * 4294967296.0), 4294967295.0)
    p.keep_scale = 1.0 / (1.0 - dropout_p)
    p.n_threads = rf(a, RA_N_THREADS)
    p.ksb, p.ksh, p.kss = kst[0], kst[1], kst[2]
    p.vsb, p.vsh, p.vss = vst[0], vst[1], vst[2]
    p.kv_kind = kv_kind
    p.kcb, p.kch, p.kcs = kcst[0], kcst[1], kcst[2]
    p.vcb, p.vch, p.vcs = vcst[0], vcst[1], vcst[2]
    p.page_size = page_size
    p.bt_ld = bts[1]
    p.seqlens = p.block_table = NULL
    if rf(a, RA_HAS_SEQLENS) or paged:
        fill_kv_layout(p, a, k.shape[0])
    # size-0 arrays have no element 0: NULL (never read)
    p.q = <const char *>q.data
    p.k = <const char *>k.data
    p.v = <const char *>v.data
    p.out = p.lse = NULL
    return 0


cdef int view_outputs(object out, object lse, ArrView *o, ArrView *l) except -1:
    """out (B, Hq, L, Ev) and lse (B, Hq, L): writable, C-contiguous, both float or both
    double. Returns 1 for double."""
    cdef char code = 0
    view_array(out, o, 4, &code, True, True, "out")
    view_array(lse, l, 3, &code, True, True, "lse")
    return code == b"d"
