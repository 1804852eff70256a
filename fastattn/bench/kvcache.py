"""Ragged batches and KV caches: fastattn's inference API against what a torch user does on CPU.

    python -m fastattn.bench --preset inference [--rounds N] [--out DIR] [--threads N]

The rows of issue 16's speed item, each timed interleaved in ONE process (the latency
preset's timing: fastattn's call and its peers alternate round by round, each a batch of
about BATCH_S seconds, with a pause after the read probe's; medians of per-round ratios):

- ragged prefill: packed sequences of RAGGED_LENS tokens, H heads, d, causal. fastattn's
  `varlen_attention` against torch's SDPA on the batch padded to the longest sequence with a
  boolean mask (causal and key padding), and against the sequences run one by one through
  `fa.scaled_dot_product_attention`;
- decode: DECODE_B sequences whose cache lengths are spread geometrically over DECODE_LENS,
  Hq/Hkv, d, one query token each, float32. fastattn's `attention_with_kvcache` on a
  contiguous flash-layout cache (B, S_max, Hkv, d) of two np.zeros arrays, on a paged one
  (pages of PAGE tokens, shuffled in a pool), and `fa.KVCache.attend` on the library's own
  contiguous cache (its K and V in one buffer, fastattn/nn.py), against torch's SDPA on the
  padded (B, Hkv, S_max, d) cache with a key padding mask. Each is also given as GB/s of the
  bytes it must read (the keys and values of the real tokens; torch reads the padding too) and
  as a fraction of the machine's read bandwidth for as many bytes, measured in the same rounds:
  a float32 matrix-vector product through NumPy's BLAS over a matrix of exactly the bytes the
  decode must read, one more callable of the interleaving (so it sees the same load; with a
  last-level cache that can hold the working set, the cache is part of "the machine's read
  bandwidth" for both);
- append: one new token written into caches of two capacities with the same short lengths:
  a cost that does not grow with the capacity shows that the cache is not copied;
- cache dtypes: decode (CACHE_DTYPES: every sequence full) over float32, float16 and int8
  caches of the same tokens, side by side: each one's time over the float32 cache's, and its
  own bytes (codes + scales for int8) per second as a share of the read probe.
"""
from __future__ import annotations

import json
import os
import statistics

import numpy as np

from .latency import SETTLE_S, _interleaved as _batches_interleaved

RAGGED_LENS = (4096, 1024, 256, 17)
RAGGED = dict(H=8, d=64)
DECODE = dict(B=8, lo=512, hi=16384, Hq=32, Hkv=8, d=128, page=256)
CACHE_DTYPES = dict(B=4, Hq=32, Hkv=8, d=128, S=16384)
APPEND = dict(B=8, Hkv=8, d=128, capacities=(1024, 16384), held=16)
PROBE = "read probe (gemv)"


# seconds of calls per callable and round (the plumbing test's small run: one call)
BATCH_S = 0.1


def _interleaved(fns: dict, rounds: int, batch_s: float) -> dict:
    """{name: [seconds per call, one per round]}: batches of about batch_s, the order
    alternating every round, a pause after the read probe's (the latency preset's timing)."""
    return _batches_interleaved(fns, rounds, batch_s, probe=PROBE)


def _sig(x: float) -> float:
    """x to 3 significant digits. Not round(x, 2): a tiny-size run on a loaded machine (the
    plumbing test) moves < 0.005 GB/s, which rounded to 2 decimals reads as a rate of 0."""
    return float(f"{x:.3g}")


def _ratio(times: dict, a: str, b: str) -> float:
    """Median over rounds of time(a) / time(b)."""
    return _sig(statistics.median(x / y for x, y in zip(times[a], times[b])))


def _ms(times: dict) -> dict:
    return {k: _sig(statistics.median(v) * 1e3) for k, v in times.items()}


def ragged_prefill(torch, rounds: int, lens=RAGGED_LENS, H=None, d=None,
                   batch_s=BATCH_S) -> dict:
    import fastattn as fa

    H = RAGGED["H"] if H is None else H
    d = RAGGED["d"] if d is None else d
    rng = np.random.default_rng(0)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v = (rng.standard_normal((int(cu[-1]), H, d), dtype=np.float32) for _ in range(3))
    seqs = [tuple(np.ascontiguousarray(x[cu[i]:cu[i + 1]].transpose(1, 0, 2))[None]
                  for x in (q, k, v)) for i in range(len(lens))]
    fns = {
        "fastattn varlen": lambda: fa.varlen_attention(q, k, v, cu, cu, is_causal=True),
        "fastattn one by one": lambda: [fa.scaled_dot_product_attention(*s, is_causal=True)
                                        for s in seqs],
    }
    if torch is not None:
        n, B = max(lens), len(lens)
        pad = np.zeros((3, B, H, n, d), np.float32)
        for i, s in enumerate(seqs):
            for j in range(3):
                pad[j, i, :, :lens[i]] = s[j][0]
        pos = np.arange(n)
        keep = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < np.array(lens)[:, None, None])
        keep |= ~keep.any(-1, keepdims=True)          # padding rows: any key (no NaN rows)
        tq, tk, tv = (torch.from_numpy(pad[j]) for j in range(3))
        tm = torch.from_numpy(keep[:, None])
        sdpa = torch.nn.functional.scaled_dot_product_attention
        fns["torch padded + mask"] = lambda: sdpa(tq, tk, tv, attn_mask=tm)
    times = _interleaved(fns, rounds, batch_s)
    rec = {"row": f"ragged prefill, lengths {tuple(lens)}, H={H}, d={d}, causal",
           "ms": _ms(times),
           "varlen_vs_one_by_one": _ratio(times, "fastattn varlen", "fastattn one by one")}
    if torch is not None:
        rec["torch_vs_varlen"] = _ratio(times, "torch padded + mask", "fastattn varlen")
    return rec


def decode_lengths(B: int, lo: int, hi: int) -> np.ndarray:
    """B cache lengths spread geometrically from lo to hi."""
    return np.round(np.geomspace(lo, hi, B)).astype(np.int32)


def ragged_decode(torch, rounds: int, B=None, lo=None, hi=None, Hq=None, Hkv=None, d=None,
                  page=None, batch_s=BATCH_S) -> dict:
    import fastattn as fa

    c = dict(DECODE)
    c.update({k: v for k, v in dict(B=B, lo=lo, hi=hi, Hq=Hq, Hkv=Hkv, d=d, page=page).items()
              if v is not None})
    B, Hq, Hkv, d, page = c["B"], c["Hq"], c["Hkv"], c["d"], c["page"]
    lens = decode_lengths(B, c["lo"], c["hi"])
    S_max = int(lens.max())
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, 1, Hq, d), dtype=np.float32)
    kc = np.zeros((B, S_max, Hkv, d), np.float32)
    vc = np.zeros((B, S_max, Hkv, d), np.float32)
    for b in range(B):                                # real tokens; the rest stays 0
        kc[b, :lens[b]] = rng.standard_normal((lens[b], Hkv, d), dtype=np.float32)
        vc[b, :lens[b]] = rng.standard_normal((lens[b], Hkv, d), dtype=np.float32)
    per_seq = -(-S_max // page)
    n_pages = [-(-int(n) // page) for n in lens]
    pool = sum(n_pages)
    order = rng.permutation(pool).astype(np.int32)    # pages scattered over the pool
    table = np.zeros((B, per_seq), np.int32)
    kp = np.zeros((pool, page, Hkv, d), np.float32)
    vp = np.zeros((pool, page, Hkv, d), np.float32)
    at = 0
    for b in range(B):
        for i in range(n_pages[b]):
            pg = order[at]
            at += 1
            table[b, i] = pg
            part = slice(i * page, min(int(lens[b]), (i + 1) * page))
            kp[pg, :part.stop - part.start] = kc[b, part]
            vp[pg, :part.stop - part.start] = vc[b, part]
    own = fa.KVCache(B, S_max, Hkv, d)               # the library's own contiguous cache
    own.k[...] = kc
    own.v[...] = vc
    own.seqlens[:] = lens
    fns = {
        "fastattn contiguous": lambda: fa.attention_with_kvcache(q, kc, vc, cache_seqlens=lens),
        "fastattn paged": lambda: fa.attention_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                            block_table=table),
        "fastattn KVCache": lambda: own.attend(q),
    }
    if torch is not None:
        tq = torch.from_numpy(np.ascontiguousarray(q.transpose(0, 2, 1, 3)))
        tk = torch.from_numpy(np.ascontiguousarray(kc.transpose(0, 2, 1, 3)))
        tv = torch.from_numpy(np.ascontiguousarray(vc.transpose(0, 2, 1, 3)))
        tm = torch.from_numpy(np.arange(S_max)[None, None, None, :] < lens[:, None, None, None])
        sdpa = torch.nn.functional.scaled_dot_product_attention
        fns["torch padded + mask"] = lambda: sdpa(tq, tk, tv, attn_mask=tm, enable_gqa=True)
    need = float(lens.sum()) * Hkv * d * 4 * 2       # the real tokens' keys and values
    cols = 1024
    probe_m = np.ones((max(1, int(need) // (4 * cols)), cols), np.float32)
    probe_x = np.ones(cols, np.float32)
    fns[PROBE] = lambda: probe_m @ probe_x
    times = _interleaved(fns, rounds, batch_s)
    bw = probe_m.nbytes / statistics.median(times[PROBE])
    rec = {"row": f"decode, B={B}, lengths {lens.tolist()}, Hq={Hq}, Hkv={Hkv}, d={d}, "
                  f"page {page}", "ms": _ms(times), "bytes_needed": need,
           "read_bandwidth_gbytes_per_s": _sig(bw / 1e9)}
    for name, ts in times.items():
        if name == PROBE:
            continue
        # per round: (bytes needed / its time) / (probe bytes / the probe's time)
        share = statistics.median((need / t) / (probe_m.nbytes / p)
                                  for p, t in zip(times[PROBE], ts))
        rec[name] = {"gbytes_per_s": _sig(need / statistics.median(ts) / 1e9),
                     "of_read_bandwidth": _sig(share)}
    if torch is not None:
        for name in ("fastattn contiguous", "fastattn paged", "fastattn KVCache"):
            rec[f"torch_vs_{name.split()[1]}"] = _ratio(times, "torch padded + mask", name)
    return rec


def cache_dtypes_decode(rounds: int, B=None, Hq=None, Hkv=None, d=None, S=None,
                        backend=None, batch_s=BATCH_S) -> dict:
    """Decode over caches of each dtype side by side (issue 34): float32, float16 and int8
    caches of the same random normal tokens (int8 quantized per token and kv head), every
    sequence S tokens long, one query token. Each row: its time, its bytes read per second
    (its own bytes: 4, 2 or 1 per element, and for int8 the float32 scales) as a share of a
    read probe over the float32 cache's bytes measured in the same rounds, and its time over
    the float32 row's (medians of per-round ratios)."""
    import fastattn as fa

    c = dict(CACHE_DTYPES)
    c.update({k: v for k, v in dict(B=B, Hq=Hq, Hkv=Hkv, d=d, S=S).items() if v is not None})
    B, Hq, Hkv, d, S = c["B"], c["Hq"], c["Hkv"], c["d"], c["S"]
    rng = np.random.default_rng(3)
    q = rng.standard_normal((B, 1, Hq, d), dtype=np.float32)
    lens = np.full(B, S, np.int32)
    caches, need = {}, {}
    for name, dtype in (("float32", np.float32), ("float16", np.float16), ("int8", np.int8)):
        cache = fa.KVCache(B, S, Hkv, d, dtype)         # aligned, K and V apart (nn.py)
        for b in range(B):                               # filled a sequence at a time
            for arr, sc in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
                x = rng.standard_normal((S, Hkv, d), dtype=np.float32)
                if dtype == np.int8:
                    arr[b], sc[b] = fa.quantize_kv(x)
                else:
                    arr[b] = x
        cache.seqlens[:] = lens
        caches[name] = cache
        scales = 0 if cache.k_scale is None else 2 * B * S * Hkv * 4
        need[name] = float(B * S * Hkv * d * 2 * cache.k.itemsize + scales)
    kw = {} if backend is None else {"backend": backend}

    def call(cache):
        sc = {} if cache.k_scale is None else dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
        return lambda: fa.attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=lens,
                                                 **sc, **kw)

    fns = {f"{name} cache": call(cache) for name, cache in caches.items()}
    cols = 1024
    probe_m = np.ones((max(1, int(need["float32"]) // (4 * cols)), cols), np.float32)
    probe_x = np.ones(cols, np.float32)
    fns[PROBE] = lambda: probe_m @ probe_x
    times = _interleaved(fns, rounds, batch_s)
    rec = {"row": f"decode over float32 / float16 / int8 caches, B={B}, Hq={Hq}, Hkv={Hkv}, "
                  f"d={d}, {S} cached tokens each" + (f", {backend}" if backend else ""),
           "ms": _ms(times), "read_bandwidth_gbytes_per_s":
               _sig(probe_m.nbytes / statistics.median(times[PROBE]) / 1e9)}
    for name in caches:
        ts = times[f"{name} cache"]
        share = statistics.median((need[name] / t) / (probe_m.nbytes / p)
                                  for p, t in zip(times[PROBE], ts))
        rec[f"{name} cache"] = {"bytes_read": need[name],
                                "gbytes_per_s": _sig(need[name] / statistics.median(ts) / 1e9),
                                "of_read_bandwidth": _sig(share),
                                "vs_float32": _ratio(times, f"{name} cache", "float32 cache")}
    return rec


def append_cost(rounds: int, B=None, Hkv=None, d=None, capacities=None, held=None,
                batch_s=BATCH_S) -> dict:
    """One token appended (and attended by one query head per KV head, over `held` keys) in
    caches of each capacity: the time should not grow with the capacity."""
    import fastattn as fa

    c = dict(APPEND)
    c.update({k: v for k, v in dict(B=B, Hkv=Hkv, d=d, capacities=capacities,
                                    held=held).items() if v is not None})
    B, Hkv, d, held = c["B"], c["Hkv"], c["d"], c["held"]
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((B, 1, Hkv, d), dtype=np.float32) for _ in range(3))
    lens = np.full(B, held, np.int32)
    fns = {}
    for cap in c["capacities"]:
        kc = np.zeros((B, cap, Hkv, d), np.float32)
        vc = np.zeros((B, cap, Hkv, d), np.float32)
        fns[f"capacity {cap}"] = (lambda kc=kc, vc=vc: fa.attention_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=lens))
    times = _interleaved(fns, rounds, batch_s)
    names = list(fns)
    return {"row": f"append 1 token + attend {held} keys, B={B}, Hkv={Hkv}, d={d}, "
                   f"capacities {tuple(c['capacities'])}", "ms": _ms(times),
            "largest_vs_smallest": _ratio(times, names[-1], names[0])}


def run(threads: int, rounds: int = 7, small: bool = False) -> dict:
    from .machine import describe, load_average

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch.set_num_threads(threads)
    meta = describe(threads, ["--preset", "inference"])
    meta.update(preset="inference", rounds=rounds,
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "unset"))
    if small:                                         # the plumbing test's sizes
        records = [ragged_prefill(torch, rounds, lens=(40, 9, 1), H=2, d=8, batch_s=0),
                   ragged_decode(torch, rounds, B=3, lo=8, hi=70, Hq=4, Hkv=2, d=8, page=16,
                                 batch_s=0),
                   append_cost(rounds, B=2, Hkv=2, d=8, capacities=(32, 256), held=4,
                               batch_s=0),
                   cache_dtypes_decode(rounds, B=2, Hq=4, Hkv=2, d=8, S=64, batch_s=0)]
    else:
        records = [ragged_prefill(torch, rounds), ragged_decode(torch, rounds),
                   append_cost(rounds), cache_dtypes_decode(rounds)]
    meta["load_average_end"] = load_average()
    return {"meta": meta, "records": records}


def markdown(data: dict) -> str:
    m = data["meta"]
    lines = [
        f"Inference preset (`python -m fastattn.bench --preset inference`), {m['date']}"
        + (f", fastattn commit {m['fastattn_commit']}" if m.get("fastattn_commit") else "")
        + f"; {m['cpu']}, **{m['threads']} threads**; torch {m['versions'].get('torch')}; "
        f"float32, auto backend; interleaved in one process, {m['rounds']} rounds of batches "
        f"of about {BATCH_S} s per callable ({SETTLE_S} s of pause after the read probe's, "
        f"whose OpenBLAS threads spin), medians (ratios: medians of per-round ratios). "
        f"Load average start/end "
        f"{m.get('load_average_start')} / {m.get('load_average_end')}; "
        f"OMP_WAIT_POLICY={m.get('omp_wait_policy')}.",
        "",
        "| row | times (ms) | ratios |",
        "|---|---|---|",
    ]
    for r in data["records"]:
        times = ", ".join(f"{k} {v:.2f}" for k, v in r["ms"].items())
        ratios = []
        if "varlen_vs_one_by_one" in r:
            ratios.append(f"varlen / one by one {r['varlen_vs_one_by_one']:.2f}")
        for key in ("torch_vs_varlen", "torch_vs_contiguous", "torch_vs_paged",
                    "torch_vs_KVCache"):
            if key in r:
                ratios.append(f"torch / fastattn {key.split('_')[-1]} {r[key]:.2f}")
        if "read_bandwidth_gbytes_per_s" in r:
            ratios.append(f"read bandwidth (gemv over the same bytes) "
                          f"{r['read_bandwidth_gbytes_per_s']:.1f} GB/s")
        for name in ("fastattn contiguous", "fastattn paged", "fastattn KVCache",
                     "torch padded + mask"):
            if name in r and "gbytes_per_s" in r[name]:
                ratios.append(f"{name}: {r[name]['gbytes_per_s']:.1f} GB/s of the needed bytes "
                              f"= {100 * r[name]['of_read_bandwidth']:.0f}% of read bandwidth")
        for name in ("float32 cache", "float16 cache", "int8 cache"):
            if name in r:
                ratios.append(f"{name}: {r[name]['gbytes_per_s']:.1f} GB/s of its own bytes = "
                              f"{100 * r[name]['of_read_bandwidth']:.0f}% of read bandwidth, "
                              f"{r[name]['vs_float32']:.2f}x the float32 cache's time")
        if "largest_vs_smallest" in r:
            ratios.append(f"largest / smallest capacity {r['largest_vs_smallest']:.2f}")
        lines.append(f"| {r['row']} | {times} | {'; '.join(ratios)} |")
    return "\n".join(lines) + "\n"


def main(threads: int, rounds: int | None, out_dir: str, small: bool = False) -> int:
    data = run(threads, rounds or 7, small=small)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "inference.json"), "w") as f:
        json.dump(data, f, indent=1)
    text = markdown(data)
    with open(os.path.join(out_dir, "inference.md"), "w") as f:
        f.write(text)
    print(text)
    return 0
