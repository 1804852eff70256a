"""Before/after speed of two source trees of fastattn, interleaved call by call in ONE process.

    python bench/ab_trees.py OLD_TREE NEW_TREE [--rounds 16] [--backends cython,numba]
                             [--cases fwd,bwd,decode] [--workdir DIR]

Each tree is a checkout (a `git worktree`) with its extension built in place
(`python setup.py build_ext --inplace`). Their `fastattn/` packages are copied to a temporary
directory as `fastattn_a` and `fastattn_b` and imported side by side (fastattn imports itself
relatively; the compiled module's init name is its last component, so a renamed package loads
it). Each round times a batch of calls of one tree, then of the other (the order alternates),
and the result per case is the median of the per-round ratios new/old with its quartiles.

Why in one process: on this shared 2-core machine, other processes' load changes within
seconds. Alternating whole benchmark processes (the bench's own method, right for comparing
with torch) left ratios spread by +-30% under load; batches of ~20 ms alternated in one process
see the same load and the same OpenMP pool, and their ratios stay within a few percent.

--workdir keeps the copies (and numba's on-disk cache in them, which stays valid while the
copied sources keep their mtimes) for the next run; by default they go to a temporary directory
and numba compiles cold (a minute or more).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

# name, kind, B, Hq, Hkv, L, S, D, causal: the targets preset (without its 32k rows, which take
# seconds per call) plus the MHA decode row of the latency issue
CASES = [
    ("fwd B1 H8 d64 L2048", "fwd", 1, 8, 8, 2048, 2048, 64, False),
    ("fwd B1 H8 d64 causal L2048", "fwd", 1, 8, 8, 2048, 2048, 64, True),
    ("fwd B1 H8 d128 L2048", "fwd", 1, 8, 8, 2048, 2048, 128, False),
    ("fwd B4 H8 d64 L256", "fwd", 4, 8, 8, 256, 256, 64, False),
    ("bwd B1 H8 d64 L1024", "bwd", 1, 8, 8, 1024, 1024, 64, False),
    ("bwd B1 H8 d64 causal L1024", "bwd", 1, 8, 8, 1024, 1024, 64, True),
    # the full preset's backward sweep at the lengths where its tiles leave L2
    ("bwd B1 H4 d64 L2048", "bwd", 1, 4, 4, 2048, 2048, 64, False),
    ("bwd B1 H4 d64 L4096", "bwd", 1, 4, 4, 4096, 4096, 64, False),
    ("bwd B1 H4 d64 causal L4096", "bwd", 1, 4, 4, 4096, 4096, 64, True),
    ("decode GQA 32/8 d128 S16384", "decode", 1, 32, 8, 1, 16384, 128, False),
    ("decode MHA 12/12 d64 S1024", "decode", 1, 12, 12, 1, 1024, 64, False),
    ("decode MHA 12/12 d64 S128", "decode", 1, 12, 12, 1, 128, 64, False),
    ("decode MHA 12/12 d64 S4096", "decode", 1, 12, 12, 1, 4096, 64, False),
    ("decode GQA 32/8 d128 S65536", "decode", 1, 32, 8, 1, 65536, 128, False),
    ("decode tiny 1/1 d64 S16", "decode", 1, 1, 1, 1, 16, 64, False),
    # the inference preset's decode (fastattn/bench/kvcache.py): B=8, lengths 512...16384,
    # Hq=32, Hkv=8, d=128, a flash-layout cache read in place; S is the page size (0: none)
    ("decode ragged B8 32/8 d128", "kvdecode", 8, 32, 8, 1, 0, 128, False),
    ("decode ragged paged256 B8 32/8 d128", "kvdecode", 8, 32, 8, 1, 256, 128, False),
]


def import_tree(tree: str, alias: str, tmp: str):
    """Import tree's fastattn package under the name `alias`."""
    src = os.path.join(os.path.abspath(tree), "fastattn")
    if not os.path.isdir(src):
        raise SystemExit(f"{tree}: no fastattn/ package there")
    dst = os.path.join(tmp, alias)
    # copy2 keeps mtimes, so a kept numba cache in dst/_numba/__pycache__ stays valid
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    # the numba backend names its kernel modules absolutely (to drop them from sys.modules on a
    # cache fallback): point those names at the copy
    nb = os.path.join(dst, "_backends", "numba_.py")
    with open(nb) as f:
        text = f.read()
    with open(nb, "w") as f:
        f.write(text.replace('"fastattn._numba."', f'"{alias}._numba."'))
    if tmp not in sys.path:
        sys.path.insert(0, tmp)
    return __import__(alias)


def _call(fa, kind, q, k, v, kw):
    if kind != "bwd":
        return lambda: fa.scaled_dot_product_attention(q, k, v, **kw)
    out, lse = fa.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    g = np.ones_like(out)
    return lambda: fa.scaled_dot_product_attention_backward(g, q, k, v, out, lse, **kw)


def _kv_decode_call(fa, rng_seed, B, Hq, Hkv, D, page):
    """attention_with_kvcache over the inference preset's ragged cache (contiguous, or paged
    when page > 0), built the same way from the same seed for both trees."""
    import importlib

    kvc = importlib.import_module(fa.__name__ + ".bench.kvcache")
    DECODE, decode_lengths = kvc.DECODE, kvc.decode_lengths
    rng = np.random.default_rng(rng_seed)
    lens = decode_lengths(B, DECODE["lo"], DECODE["hi"])
    S_max = int(lens.max())
    q = rng.standard_normal((B, 1, Hq, D), dtype=np.float32)
    kc = np.zeros((B, S_max, Hkv, D), np.float32)
    vc = np.zeros((B, S_max, Hkv, D), np.float32)
    for b in range(B):
        kc[b, :lens[b]] = rng.standard_normal((lens[b], Hkv, D), dtype=np.float32)
        vc[b, :lens[b]] = rng.standard_normal((lens[b], Hkv, D), dtype=np.float32)
    if not page:
        return lambda be: fa.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, backend=be)
    n_pages = [-(-int(n) // page) for n in lens]
    order = rng.permutation(sum(n_pages)).astype(np.int32)      # pages scattered
    table = np.zeros((B, -(-S_max // page)), np.int32)
    kp = np.zeros((sum(n_pages), page, Hkv, D), np.float32)
    vp = np.zeros_like(kp)
    at = 0
    for b in range(B):
        for i in range(n_pages[b]):
            pg = order[at]
            at += 1
            table[b, i] = pg
            part = slice(i * page, min(int(lens[b]), (i + 1) * page))
            kp[pg, :part.stop - part.start] = kc[b, part]
            vp[pg, :part.stop - part.start] = vc[b, part]
    return lambda be: fa.attention_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                 block_table=table, backend=be)


def _batch_time(f, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--backends", default="cython,numba")
    ap.add_argument("--cases", default="fwd,bwd,decode",
                    help="kinds to run, comma-separated (fwd, bwd, decode)")
    ap.add_argument("--batch-ms", type=float, default=20.0, help="time of one timed batch")
    ap.add_argument("--workdir", help="keep the package copies here (numba's cache survives)")
    args = ap.parse_args(argv)
    tmp = os.path.abspath(args.workdir) if args.workdir else tempfile.mkdtemp(prefix="fastattn_ab_")
    os.makedirs(tmp, exist_ok=True)
    try:
        fa_old = import_tree(args.old, "fastattn_a", tmp)
        fa_new = import_tree(args.new, "fastattn_b", tmp)
        # Source-built trees link the same libgomp.so.1: the second tree to load it would take
        # it for another library's spinning one (fastattn/_process.py: passive_openmp_wait) and
        # choose decode threads for a spinning pool (MHA decode S=128 on two sleeping threads:
        # 1.7x the time).  Load the old tree's backends first and hand its reading on.
        fa_old.backends()
        fa_new._process._state["openmp_passive"] = fa_old._process._state["openmp_passive"]
        kinds = set(args.cases.split(","))
        rng = np.random.default_rng(0)
        print(f"old {args.old}  new {args.new}  rounds {args.rounds}  "
              f"load {' '.join(open('/proc/loadavg').read().split()[:3])}")
        print(f"{'backend':8s} {'case':30s} {'old ms':>9s} {'new ms':>9s}  new/old (q1, q3)")
        for be in args.backends.split(","):
            for name, kind, B, Hq, Hkv, L, S, D, causal in CASES:
                if kind == "kvdecode":
                    if "decode" not in kinds:
                        continue
                    fo = _kv_decode_call(fa_old, 1, B, Hq, Hkv, D, S)
                    fn = _kv_decode_call(fa_new, 1, B, Hq, Hkv, D, S)
                    f_old, f_new = (lambda fo=fo, be=be: fo(be)), (lambda fn=fn, be=be: fn(be))
                elif kind not in kinds:
                    continue
                else:
                    q = rng.standard_normal((B, Hq, L, D), dtype=np.float32)
                    k = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
                    v = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
                    kw = dict(is_causal=causal, enable_gqa=Hq != Hkv, backend=be)
                    f_old = _call(fa_old, kind, q, k, v, kw)
                    f_new = _call(fa_new, kind, q, k, v, kw)
                for f in (f_old, f_new, f_old, f_new):      # JIT, caches, pools warm
                    f()
                n = max(1, int(args.batch_ms / 1e3 / _batch_time(f_new, 1)))
                t_old, t_new, ratios = [], [], []
                for r in range(args.rounds):
                    first_old = r % 2 == 0
                    a = _batch_time(f_old if first_old else f_new, n)
                    b = _batch_time(f_new if first_old else f_old, n)
                    to, tn = (a, b) if first_old else (b, a)
                    t_old.append(to)
                    t_new.append(tn)
                    ratios.append(tn / to)
                q1, q3 = np.quantile(ratios, [0.25, 0.75])
                print(f"{be:8s} {name:30s} {statistics.median(t_old) * 1e3:9.3f} "
                      f"{statistics.median(t_new) * 1e3:9.3f}  {statistics.median(ratios):.3f} "
                      f"({q1:.3f}, {q3:.3f})", flush=True)
        print(f"load at end {' '.join(open('/proc/loadavg').read().split()[:3])}")
    finally:
        if not args.workdir:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
