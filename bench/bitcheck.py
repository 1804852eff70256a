"""Record, then compare, the exact bits of every backend's results on a fixed set of cases.

A refactor of the kernel plumbing must not change a single result. Run `record` on the commit
before the change and `compare` after it:

    python bench/bitcheck.py record /tmp/bits-before.npz     # on the old commit
    python bench/bitcheck.py compare /tmp/bits-before.npz    # on the new one

Each case is a seeded problem (every score option, dtype, the decode and tiled paths, GQA, odd
sizes); each is run forward (out, lse) and backward (dq, dk, dv) in every available backend and,
for cython, in every SIMD copy the CPU runs. `compare` prints every array that differs in even
one bit, and exits 1 if any does. Record and compare with numba's cache warm (run the script
once before recording): numba's float64 kernels compiled cold in the recording process gave
results differing in the last bit from the same kernels loaded from its cache. Run it from a checkout with the extension built in place
(`python setup.py build_ext --inplace`) or against an installed package.
"""
from __future__ import annotations

import sys
import zlib

import numpy as np

import fastattn as fa

# name -> (B, Hq, Hkv, L, S, E, Ev, dtype, options). Options are sdpa keyword arguments plus
# "mask": "bool" | "float" | "bool_bcast" | "float_rows" | "pad" (built from the seed below).
_BASE = [
    ("plain", (1, 2, 2, 37, 53, 16, 16, "float32", {})),
    ("tiled", (1, 2, 2, 300, 600, 64, 64, "float32", {})),
    ("tiled_d128", (1, 1, 1, 129, 513, 128, 128, "float32", {})),
    ("odd_dims", (2, 3, 3, 17, 113, 33, 7, "float32", {})),
    ("head_dim1", (1, 2, 2, 9, 11, 1, 1, "float32", {})),
    ("causal_tl", (1, 2, 2, 203, 203, 64, 64, "float32", {"is_causal": True})),
    ("causal_tl_LgtS", (1, 2, 2, 129, 64, 32, 32, "float32", {"is_causal": True})),
    ("causal_br", (1, 2, 2, 64, 300, 64, 64, "float32",
                   {"is_causal": True, "causal_alignment": "bottom_right"})),
    ("window", (1, 2, 2, 257, 257, 32, 32, "float32", {"window": (40, 7)})),
    ("window_causal_br", (1, 2, 2, 100, 333, 32, 32, "float32",
                          {"window": (50, None), "is_causal": True,
                           "causal_alignment": "bottom_right"})),
    ("softcap", (1, 2, 2, 130, 140, 64, 64, "float32", {"softcap": 5.0})),
    ("alibi_h", (1, 4, 4, 77, 99, 32, 32, "float32", {"alibi": "h"})),
    ("alibi_bh", (2, 4, 4, 33, 65, 16, 16, "float32", {"alibi": "bh", "is_causal": True})),
    ("mask_bool", (2, 2, 2, 70, 90, 32, 32, "float32", {"mask": "bool"})),
    ("mask_bool_bcast", (2, 2, 2, 70, 90, 32, 32, "float32", {"mask": "bool_bcast"})),
    ("mask_float", (2, 2, 2, 70, 90, 32, 32, "float32", {"mask": "float"})),
    ("mask_float_rows", (1, 3, 3, 50, 60, 16, 16, "float32", {"mask": "float_rows"})),
    ("mask_pad", (3, 2, 2, 40, 128, 32, 32, "float32", {"mask": "pad"})),
    ("fully_masked_rows", (1, 2, 2, 30, 40, 16, 16, "float32", {"mask": "empty_rows"})),
    ("dropout", (1, 2, 2, 100, 120, 32, 32, "float32", {"dropout_p": 0.3, "rng": 7})),
    ("dropout_causal", (2, 2, 2, 64, 64, 16, 16, "float32",
                        {"dropout_p": 0.1, "rng": 12345, "is_causal": True})),
    ("gqa", (1, 8, 2, 120, 250, 64, 64, "float32", {"enable_gqa": True})),
    ("mqa_causal", (1, 4, 1, 90, 90, 32, 32, "float32", {"enable_gqa": True, "is_causal": True})),
    ("decode_mha", (2, 4, 4, 1, 700, 64, 64, "float32", {})),
    ("decode_mha_long", (1, 2, 2, 1, 3000, 128, 128, "float32", {})),
    ("decode_gqa", (1, 8, 2, 1, 1500, 128, 128, "float32", {"enable_gqa": True})),
    ("decode_rows4", (1, 4, 2, 4, 900, 64, 64, "float32",
                      {"enable_gqa": True, "is_causal": True, "causal_alignment": "bottom_right"})),
    ("decode_mask", (2, 2, 2, 1, 500, 32, 32, "float32", {"mask": "pad"})),
    ("decode_softcap_alibi", (1, 4, 4, 2, 400, 64, 64, "float32",
                              {"softcap": 20.0, "alibi": "h"})),
    ("decode_window", (1, 2, 2, 3, 600, 32, 32, "float32",
                       {"window": (100, 0), "causal_alignment": "bottom_right"})),
    ("everything", (2, 4, 2, 75, 150, 32, 24, "float32",
                    {"enable_gqa": True, "is_causal": True, "causal_alignment": "bottom_right",
                     "window": (60, None), "softcap": 10.0, "alibi": "h", "mask": "float",
                     "dropout_p": 0.2, "rng": 3})),
    ("nonfinite_masked_kv", (1, 2, 2, 20, 64, 16, 16, "float32", {"mask": "pad", "nan_tail": True})),
    ("scale", (1, 2, 2, 40, 50, 16, 16, "float32", {"scale": 0.37})),
]
# the same problems in float64, and a few in float16 (computed in float32, cast back)
CASES = dict(_BASE)
for _name, (_B, _Hq, _Hkv, _L, _S, _E, _Ev, _dt, _opt) in _BASE:
    CASES[_name + "_f64"] = (_B, _Hq, _Hkv, _L, _S, _E, _Ev, "float64", _opt)
for _name in ("plain", "causal_br", "decode_gqa", "mask_float", "everything"):
    _B, _Hq, _Hkv, _L, _S, _E, _Ev, _dt, _opt = CASES[_name]
    CASES[_name + "_f16"] = (_B, _Hq, _Hkv, _L, _S, _E, _Ev, "float16", _opt)


def build(name: str):
    """The arrays and sdpa keyword arguments of one case, from a seed derived from its name."""
    B, Hq, Hkv, L, S, E, Ev, dtype, opt = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    dt = np.dtype(dtype)
    q = rng.standard_normal((B, Hq, L, E)).astype(dt)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dt)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(dt)
    dout = rng.standard_normal((B, Hq, L, Ev)).astype(dt)
    kw = {key: val for key, val in opt.items() if key not in ("mask", "alibi", "nan_tail")}
    mask = opt.get("mask")
    if mask == "bool":
        kw["attn_mask"] = rng.random((B, Hq, L, S)) > 0.3
    elif mask == "bool_bcast":
        kw["attn_mask"] = rng.random((1, 1, L, S)) > 0.5
    elif mask == "float":
        m = rng.standard_normal((B, 1, L, S)).astype(dt)
        m[rng.random(m.shape) < 0.2] = -np.inf
        kw["attn_mask"] = m
    elif mask == "float_rows":
        kw["attn_mask"] = rng.standard_normal((1, Hq, L, 1)).astype(dt)
    elif mask == "pad":
        lengths = rng.integers(1, S + 1, size=B)
        lengths[0] = S
        kw["attn_mask"] = fa.padding_mask(lengths, S)
        if opt.get("nan_tail") and lengths[-1] < S:
            k[-1, :, lengths[-1]:] = np.nan
            v[-1, :, lengths[-1]:] = np.inf
    elif mask == "empty_rows":
        m = rng.random((1, Hq, L, S)) > 0.5
        m[:, :, ::3] = False
        kw["attn_mask"] = m
    if opt.get("alibi") == "h":
        kw["alibi_slopes"] = (0.5 ** np.arange(1, Hq + 1)).astype(dt)
    elif opt.get("alibi") == "bh":
        kw["alibi_slopes"] = rng.random((B, Hq)).astype(dt) * 0.3
    return q, k, v, dout, kw


def run_case(name: str, backend: str) -> dict:
    q, k, v, dout, kw = build(name)
    out, lse = fa.scaled_dot_product_attention(q, k, v, return_lse=True, backend=backend, **kw)
    dq, dk, dv = fa.scaled_dot_product_attention_backward(dout, q, k, v, out, lse,
                                                          backend=backend, **kw)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _variants():
    """(label, backend, setup) for every backend and cython SIMD copy available here."""
    info = fa.backends()
    found = []
    if info["cython"].available:
        from fastattn import _cykernels
        for level in _cykernels.simd_levels():
            found.append((f"cython-{level}", "cython", lambda lv=level: _cykernels.set_simd(lv)))
    for name in ("numba", "numpy"):
        if info[name].available:
            found.append((name, name, lambda: None))
    return found


def collect() -> dict:
    results = {}
    for label, backend, setup in _variants():
        setup()
        for name in CASES:
            for field, arr in run_case(name, backend).items():
                results[f"{name}|{label}|{field}"] = arr
    if fa.backends()["cython"].available:
        from fastattn import _cykernels
        _cykernels.set_simd(None)
    return results


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("record", "compare"):
        print(__doc__)
        return 2
    mode, path = argv
    results = collect()
    if mode == "record":
        np.savez_compressed(path, **{key.replace("|", "__"): val for key, val in results.items()})
        labels = sorted({key.split("|")[1] for key in results})
        print(f"recorded {len(results)} arrays: {len(CASES)} cases x {labels} -> {path}")
        return 0
    saved = {key.replace("__", "|"): val for key, val in np.load(path).items()}
    differ, missing = [], sorted(set(saved) - set(results))
    for key, val in results.items():
        if key not in saved:
            missing.append(key + " (new)")
            continue
        old = saved[key]
        if old.shape != val.shape or old.dtype != val.dtype or not np.array_equal(_bits(old), _bits(val)):
            with np.errstate(invalid="ignore"):
                err = (np.nanmax(np.abs(old.astype(np.float64) - val.astype(np.float64)))
                       if old.shape == val.shape and old.size else float("nan"))
            differ.append(f"{key}: max |diff| {err:.3g}")
    same = len(results) - len(differ)
    print(f"{same} of {len(results)} arrays identical bit for bit "
          f"({len(CASES)} cases); {len(differ)} differ, {len(missing)} not in both")
    for line in differ + missing:
        print("  " + line)
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
