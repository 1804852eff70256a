"""cython vs numba on the inference preset's decode row, interleaved in ONE process.

    python bench/kv_decode_backends.py [ROUNDS]       (from a tree with the extension built)

attention_with_kvcache, one query token per sequence, float32: B=8 sequences with cache lengths
spread geometrically over 512..16384 (fastattn.bench.kvcache.DECODE), Hq=32, Hkv=8, d=128, on
a contiguous flash-layout cache (B, S_max, Hkv, d) and on a paged one (pages of 256 tokens
shuffled in a pool). Prints each call's median time, GB/s of the bytes it must read (the keys
and values of the real tokens) and the median per-round ratio numba / cython.
"""
import statistics
import sys
import time

import numpy as np

import fastattn as fa
from fastattn.bench.kvcache import DECODE, decode_lengths


def main(rounds: int = 20) -> None:
    B, Hq, Hkv, d, page = DECODE["B"], DECODE["Hq"], DECODE["Hkv"], DECODE["d"], DECODE["page"]
    lens = decode_lengths(B, DECODE["lo"], DECODE["hi"])
    S_max = int(lens.max())
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, 1, Hq, d), dtype=np.float32)
    kc = np.zeros((B, S_max, Hkv, d), np.float32)
    vc = np.zeros_like(kc)
    for b in range(B):
        kc[b, :lens[b]] = rng.standard_normal((lens[b], Hkv, d), dtype=np.float32)
        vc[b, :lens[b]] = rng.standard_normal((lens[b], Hkv, d), dtype=np.float32)
    n_pages = [-(-int(n) // page) for n in lens]
    order = rng.permutation(sum(n_pages)).astype(np.int32)
    table = np.zeros((B, -(-S_max // page)), np.int32)
    kp = np.zeros((sum(n_pages), page, Hkv, d), np.float32)
    vp = np.zeros_like(kp)
    at = 0
    for b in range(B):
        for i in range(n_pages[b]):
            pg = table[b, i] = order[at]
            at += 1
            n = min(page, int(lens[b]) - i * page)
            kp[pg, :n] = kc[b, i * page:i * page + n]
            vp[pg, :n] = vc[b, i * page:i * page + n]
    nbytes = int(lens.sum()) * Hkv * d * 4 * 2
    fns = {}
    for be in ("cython", "numba"):
        fns[f"{be} contiguous"] = lambda be=be: fa.attention_with_kvcache(
            q, kc, vc, cache_seqlens=lens, backend=be)
        fns[f"{be} paged"] = lambda be=be: fa.attention_with_kvcache(
            q, kp, vp, cache_seqlens=lens, block_table=table, backend=be)
    want = fns["cython contiguous"]()
    for name, f in fns.items():                       # warm-up (numba compiles) and check
        np.testing.assert_allclose(f(), want, rtol=2e-5, atol=2e-5, err_msg=name)
    times = {k: [] for k in fns}
    for r in range(rounds):
        for name, f in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    print(f"lengths {lens.tolist()}, {nbytes / 1e6:.1f} MB of real K/V, {rounds} rounds, "
          f"load {' '.join(open('/proc/loadavg').read().split()[:3])}")
    for name, t in times.items():
        m = statistics.median(t)
        print(f"{name:20s} {m * 1e3:8.2f} ms  {nbytes / m / 1e9:6.1f} GB/s")
    for lay in ("contiguous", "paged"):
        ratio = statistics.median(a / b for a, b in zip(times[f"numba {lay}"],
                                                        times[f"cython {lay}"]))
        print(f"numba / cython, {lay}: {ratio:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
