"""The per-token loop: microsecond calls, fastattn against torch interleaved in ONE process.

    python -m fastattn.bench --preset latency [--rounds N] [--out DIR] [--threads N]

The other presets time each implementation in its own process, which is right for
milliseconds-long calls; a decode step is 5-500 us, where process-to-process drift on this
shared machine is larger than the differences. So here fastattn (auto backend) and torch's
SDPA alternate batch by batch in one process and each row reports the median over rounds of
the per-round time ratio. Rows:

- single calls (B, Hq/Hkv, L=1, S, d), float32: a tiny call (pure overhead), GPT-2-small decode
  (12 heads, d=64) at three cache lengths, and a GQA decode; each also as a fraction of the
  read bandwidth of the cache level its K/V fit in, measured in the same run (a float32
  matrix-vector product through NumPy's BLAS over a matrix of that size);
- the decode loop: a 12-layer, 12-head, d=64 model's attention over 256 generated tokens with
  a growing (B, H, S_max, d) cache, as tokens per second. Each step writes the new key/value
  into the cache and attends over the first t+1 positions (`cache[:, :, :t+1]`, the same
  slices for both); fastattn's kernels want contiguous keys, so it copies that strided view
  each call. A second row gives fastattn the whole contiguous buffer and a key range instead
  (window=(0, t)), which reads the same t+1 keys without the copy.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np

# (name, B, Hq, Hkv, S, d); L = 1 everywhere
ROWS = (
    ("tiny call", 1, 1, 1, 16, 64),
    ("MHA decode", 1, 12, 12, 128, 64),
    ("MHA decode", 1, 12, 12, 1024, 64),
    ("MHA decode", 1, 12, 12, 4096, 64),
    ("GQA decode", 1, 32, 8, 16384, 128),
)
LOOP = dict(layers=12, heads=12, d=64, tokens=256)
DRAM_BYTES = 256 << 20          # the DRAM probe's matrix: far larger than any cache here


def _cache_sizes() -> dict:
    """Per-core L2 and shared L3 in bytes (glibc's sysconf, else Linux's sysfs; Zen-like
    defaults otherwise). (Python's os.sysconf does not know SC_LEVEL*_CACHE_SIZE everywhere.)"""
    out = {"L2": 1 << 20, "L3": 32 << 20}
    for name, key, index in (("L2", "SC_LEVEL2_CACHE_SIZE", 2), ("L3", "SC_LEVEL3_CACHE_SIZE", 3)):
        v = 0
        try:
            v = os.sysconf(key)
        except (ValueError, OSError):
            try:
                with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as fh:
                    raw = fh.read().strip().upper()
                v = int(raw[:-1]) << {"K": 10, "M": 20, "G": 30}[raw[-1]] if raw[-1] in "KMG" \
                    else int(raw)
            except (OSError, ValueError, KeyError, IndexError):
                v = 0
        if v and v > 0:
            out[name] = int(v)
    return out


def level_of(nbytes: float, caches: dict, threads: int) -> str:
    """The memory level a call's K/V live in when it is repeated: L2 (all cores'), L3, DRAM."""
    if nbytes <= caches["L2"] * threads * 0.75:
        return "L2"
    if nbytes <= caches["L3"] * 0.75:
        return "L3"
    return "DRAM"


def _probe_arrays(nbytes: int):
    """The read probe's float32 matrix of about nbytes (rows of 1024) and its vector."""
    cols = 1024
    return (np.ones((max(1, nbytes // (4 * cols)), cols), np.float32),
            np.ones(cols, np.float32))


def gemv_bandwidth(nbytes: int, threads: int, seconds: float) -> float:
    """Read GB/s of a float32 gemv (NumPy's BLAS) over a matrix of nbytes: the best time over
    its repeats, with the BLAS on 1 thread and on `threads` (on a loaded machine the
    multi-threaded probe may never get its cores; the one-thread one still gives a floor)."""
    from threadpoolctl import threadpool_limits

    m, x = _probe_arrays(nbytes)
    best = float("inf")
    for nt in sorted({1, threads}):
        with threadpool_limits(nt):
            m @ x
            t_end = time.perf_counter() + seconds / 2
            while time.perf_counter() < t_end:
                t = time.perf_counter()
                m @ x
                best = min(best, time.perf_counter() - t)
    return m.nbytes / best / 1e9


def measure_bandwidth(caches: dict, threads: int, seconds: float = 0.3) -> dict:
    """Read GB/s of a float32 gemv over a matrix sized for each level (gemv_bandwidth)."""
    sizes = {"L2": caches["L2"] * threads // 2, "L3": min(caches["L3"] // 2, 64 << 20),
             "DRAM": DRAM_BYTES}
    return {level: gemv_bandwidth(nbytes, threads, seconds) for level, nbytes in sizes.items()}


PROBE = "read probe"
# OpenBLAS's threads busy-wait after a multi-threaded call (up to 2^28 cycles, ~0.1 s), taking
# a core from whatever runs next: a pause after each batch of the interleaved probe, untimed
# (without it the decode timed right after the probe lost a core for most of its batch)
SETTLE_S = 0.2


def _interleaved(fns: dict, rounds: int, target_s: float, probe: str = PROBE) -> dict:
    """{name: [seconds per call per round]}: the callables alternate batch by batch, each batch
    about target_s long (its own call count: a 20 ms decode timed once per round against a
    0.4 s torch call was mostly noise); after a batch of the read probe, SETTLE_S of pause."""
    for f in fns.values():                            # warm-up (also numba's compile)
        f()
        f()
    if probe in fns:
        time.sleep(SETTLE_S)
    n = {}
    for name, f in fns.items():                       # each callable's batch size
        t = time.perf_counter()
        f()
        n[name] = max(1, min(2000, int(target_s / max(time.perf_counter() - t, 1e-7))))
        if name == probe:
            time.sleep(SETTLE_S)
    times = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]
        for name, f in order:
            t = time.perf_counter()
            for _ in range(n[name]):
                f()
            times[name].append((time.perf_counter() - t) / n[name])
            if name == probe:
                time.sleep(SETTLE_S)
    return times


def _ratio(times: dict, a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def _row(name, B, Hq, Hkv, S, d, torch, rounds, target_s, caches, threads, probe_s) -> dict:
    import fastattn as fa

    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, 1, d), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, S, d), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, S, d), dtype=np.float32)
    gqa = Hq != Hkv
    fns = {"fastattn": lambda: fa.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)}
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        fns["torch"] = lambda: sdpa(tq, tk, tv, enable_gqa=gqa)
    nbytes = 4.0 * (k.size + v.size + 2 * q.size)
    level = level_of(nbytes, caches, threads)
    # DRAM rows: the same gemv as the limit's, interleaved with the calls (the limit below is
    # its best repeat at a quiet moment, this one is timed like the rows, medians of batches).
    # Not for cache-sized rows: there the probe's matrix is evicted by the calls between its
    # batches and the other libraries' spinning threads took its cores (7.7 GB/s at 6 MB)
    if level == "DRAM":
        pm, px = _probe_arrays(int(nbytes))
        fns[PROBE] = lambda: pm @ px
    times = _interleaved(fns, rounds, target_s)
    probe = times.pop(PROBE, None)
    # the limit: a gemv reading as many bytes (the level's probe sized like this row's K/V,
    # so a level boundary guessed wrong -- VMs report odd L3 sizes -- cannot skew it)
    limit = gemv_bandwidth(int(nbytes), threads, probe_s)
    rec = {"row": f"{name} ({B}, {Hq}/{Hkv}, 1, {S}, {d})", "shape": [B, Hq, Hkv, 1, S, d],
           "limit": f"{level} bandwidth", "limit_gbytes_per_s": round(limit, 1)}
    if probe:
        rec["probe_interleaved_gbytes_per_s"] = round(pm.nbytes / statistics.median(probe) / 1e9, 1)
    for impl, ts in times.items():
        med = statistics.median(ts)
        rec[impl] = {"us_per_call": round(med * 1e6, 2),
                     "gbytes_per_s": round(nbytes / med / 1e9, 2),
                     "of_limit": float(f"{nbytes / med / 1e9 / limit:.4g}")}
        if probe:       # per round: (bytes / the call's time) / (probe bytes / the probe's time)
            share = statistics.median((nbytes / t) / (pm.nbytes / pt) for t, pt in zip(ts, probe))
            rec[impl]["of_probe_interleaved"] = float(f"{share:.4g}")
    if "torch" in times:
        rec["time_vs_torch"] = round(_ratio(times, "fastattn", "torch"), 3)
    return rec


def _decode_loop(torch, rounds: int, contiguous: bool) -> dict:
    """Tokens/s of the attention of LOOP's model over LOOP['tokens'] steps, from an empty cache."""
    import fastattn as fa

    L_, H, d, T = LOOP["layers"], LOOP["heads"], LOOP["d"], LOOP["tokens"]
    rng = np.random.default_rng(1)
    caches = [(np.zeros((1, H, T, d), np.float32), np.zeros((1, H, T, d), np.float32))
              for _ in range(L_)]
    steps = rng.standard_normal((3, 1, H, 1, d), dtype=np.float32)   # q, k, v of a token

    def fastattn_loop():
        q, kn, vn = steps
        for t in range(T):
            for kc, vc in caches:
                kc[:, :, t:t + 1] = kn
                vc[:, :, t:t + 1] = vn
                if contiguous:
                    fa.scaled_dot_product_attention(q, kc, vc, window=(0, t))
                else:
                    fa.scaled_dot_product_attention(q, kc[:, :, :t + 1], vc[:, :, :t + 1])

    fns = {"fastattn": fastattn_loop}
    if torch is not None:
        tcaches = [(torch.from_numpy(kc), torch.from_numpy(vc)) for kc, vc in caches]
        tq, tkn, tvn = (torch.from_numpy(a) for a in steps)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def torch_loop():
            for t in range(T):
                for kc, vc in tcaches:
                    kc[:, :, t:t + 1] = tkn
                    vc[:, :, t:t + 1] = tvn
                    sdpa(tq, kc[:, :, :t + 1], vc[:, :, :t + 1])

        fns["torch"] = torch_loop
    times = {k: [] for k in fns}
    fns["fastattn"]()                                    # warm-up
    for r in range(rounds):
        order = list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]
        for name, f in order:
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    how = ("whole buffer, window=(0, t)" if contiguous else "cache[:, :, :t+1] views")
    rec = {"row": f"decode loop: {L_} layers x {H} heads, d={d}, {T} tokens (fastattn: {how})",
           "limit": "call overhead (caches from 1 to 256 keys)"}
    for impl, ts in times.items():
        rec[impl] = {"tokens_per_s": round(T / statistics.median(ts), 1),
                     "ms_per_token": round(statistics.median(ts) / T * 1e3, 3)}
    if "torch" in times:
        rec["time_vs_torch"] = round(_ratio(times, "fastattn", "torch"), 3)
    return rec


def run(threads: int, rounds: int = 15, target_ms: float = 20.0, loop_rounds: int = 5,
        rows=None, loop: bool = True) -> dict:
    from .machine import describe, load_average

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch.set_num_threads(threads)
    caches = _cache_sizes()
    meta = describe(threads, ["--preset", "latency"])
    meta.update(preset="latency", rounds=rounds, caches=caches,
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "unset"))
    probe_s = 0.3 if rows is None else 0.01
    bw = measure_bandwidth(caches, threads, probe_s)
    records = [_row(*r, torch, rounds, target_ms / 1e3, caches, threads, probe_s)
               for r in (ROWS if rows is None else rows)]
    if loop:
        records.append(_decode_loop(torch, loop_rounds, contiguous=False))
        records.append(_decode_loop(torch, loop_rounds, contiguous=True))
    meta["load_average_end"] = load_average()
    return {"meta": meta, "bandwidth_gbytes_per_s": {k: round(v, 1) for k, v in bw.items()},
            "records": records}


def markdown(data: dict) -> str:
    m = data["meta"]
    bw = ", ".join(f"{k} {v} GB/s" for k, v in data["bandwidth_gbytes_per_s"].items())
    lines = [
        f"Latency preset (`python -m fastattn.bench --preset latency`), {m['date']}"
        + (f", fastattn commit {m['fastattn_commit']}" if m.get("fastattn_commit") else "")
        + f"; {m['cpu']}, **{m['threads']} threads**; torch {m['versions'].get('torch')}; "
        f"float32, auto backend; fastattn and torch interleaved in one process, {m['rounds']} "
        f"rounds, medians (ratio = median of the per-round time ratios, < 1: fastattn faster). "
        f"Read bandwidth measured in the run (float32 gemv through NumPy's BLAS, best of its "
        f"repeats on 1 and {m['threads']} threads): {bw}; each row's limit is the same probe "
        f"over as many bytes as the row reads. The last column (DRAM rows) times that probe like "
        f"the rows (interleaved with them, {SETTLE_S} s of pause after its batches for OpenBLAS's "
        f"spinning threads) and gives the median over rounds of fastattn's bandwidth / the "
        f"probe's. Load average start/end "
        f"{m.get('load_average_start')} / {m.get('load_average_end')} (a shared machine). "
        f"OMP_WAIT_POLICY={m.get('omp_wait_policy')}: both libraries' OpenMP pools share this "
        f"process; with torch's libgomp spinning after its calls (its default) on a loaded "
        f"machine, 2-thread calls of either library waited milliseconds for a core.",
        "",
        "| row | fastattn | torch | time vs torch | limit | fastattn % of limit | "
        "fastattn % of the probe interleaved |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in data["records"]:
        fa_, th = r.get("fastattn", {}), r.get("torch", {})
        if "us_per_call" in fa_:
            cells = (f"{fa_['us_per_call']:.1f} us", f"{th['us_per_call']:.1f} us" if th else "",
                     f"{r['limit']} ({r['limit_gbytes_per_s']} GB/s)",
                     f"{100 * fa_['of_limit']:.0f}% ({fa_['gbytes_per_s']:.1f} GB/s)",
                     f"{100 * fa_['of_probe_interleaved']:.0f}% (probe "
                     f"{r['probe_interleaved_gbytes_per_s']} GB/s)"
                     if "of_probe_interleaved" in fa_ else "")
        else:
            cells = (f"{fa_['tokens_per_s']:.0f} tok/s", f"{th['tokens_per_s']:.0f} tok/s" if th
                     else "", r["limit"], "", "")
        ratio = f"{r['time_vs_torch']:.2f}" if "time_vs_torch" in r else ""
        lines.append(f"| {r['row']} | {cells[0]} | {cells[1]} | {ratio} | {cells[2]} | "
                     f"{cells[3]} | {cells[4]} |")
    return "\n".join(lines) + "\n"


START, END = "<!-- latency:start -->", "<!-- latency:end -->"


def update_readme(readme: str, text: str) -> None:
    """Put `text` between the latency markers of README (after the benchmark section the first
    time), so the README's latency table is always a run's output, never typed."""
    with open(readme) as f:
        old = f.read()
    block = f"{START}\n{text}{END}"
    if START in old and END in old:
        new = old[:old.index(START)] + block + old[old.index(END) + len(END):]
    else:
        from .report import END as BENCH_END
        at = old.index(BENCH_END) + len(BENCH_END)
        new = old[:at] + "\n\n### Latency: the per-token loop\n\n" + block + old[at:]
    if new != old:
        with open(readme, "w") as f:
            f.write(new)


def main(threads: int, rounds: int | None, out_dir: str, readme: str | None = None) -> int:
    data = run(threads, rounds or 15)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "latency.json"), "w") as f:
        json.dump(data, f, indent=1)
    text = markdown(data)
    with open(os.path.join(out_dir, "latency.md"), "w") as f:
        f.write(text)
    if readme:
        update_readme(readme, text)
    print(text)
    return 0
