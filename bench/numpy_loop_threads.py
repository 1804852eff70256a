"""Thread settings for a decode step inside a NumPy model loop, each in a fresh process.

    python bench/numpy_loop_threads.py [--keys 128 1024 4096] [--batch-s 0.1] [--rounds 11]

A step is a GPT-2-small layer's QKV product (1 x 768 @ 768 x 2304, NumPy's BLAS) followed by
fastattn's decode over 12 heads, d = 64, `keys` cached keys. After its product, OpenBLAS's
threads spin for a while and hold the other core, so fastattn's second thread competes with
them; with fastattn's libgomp sleeping between calls (its default without torch), each
two-thread call also wakes a worker first. The settings (environment variables, read when the
libraries load, hence one process each): the defaults, FASTATTN_NUM_THREADS=1,
OPENBLAS_NUM_THREADS=1. Printed per setting: microseconds per step, and per product and per
attention call timed alone (medians of `rounds` batches of about `batch-s` seconds).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = r"""
import statistics, sys, time
import numpy as np
import fastattn as fa
S, batch_s, rounds = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 12, 1, 64), dtype=np.float32)
k, v = (rng.standard_normal((1, 12, S, 64), dtype=np.float32) for _ in range(2))
x = rng.standard_normal((1, 768), dtype=np.float32)
W = rng.standard_normal((768, 2304), dtype=np.float32) * 0.01
fns = {"step": lambda: (x @ W, fa.scaled_dot_product_attention(q, k, v)),
       "product": lambda: x @ W,
       "attention": lambda: fa.scaled_dot_product_attention(q, k, v)}
out = []
for name, f in fns.items():
    for _ in range(20):
        f()
    ts = []
    for _ in range(rounds):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < batch_s:
            f()
            n += 1
        ts.append((time.perf_counter() - t0) / n)
    out.append(f"{name} {statistics.median(ts) * 1e6:.1f}")
print(", ".join(out))
"""

SETTINGS = {"defaults": {},
            "FASTATTN_NUM_THREADS=1": {"FASTATTN_NUM_THREADS": "1"},
            "OPENBLAS_NUM_THREADS=1": {"OPENBLAS_NUM_THREADS": "1"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--batch-s", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args(argv)
    base = {k: v for k, v in os.environ.items()
            if k not in ("FASTATTN_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    print("us per call; a step = product + attention, one process per setting")
    for S in args.keys:
        for label, extra in SETTINGS.items():
            res = subprocess.run([sys.executable, "-c", CHILD, str(S), str(args.batch_s),
                                  str(args.rounds)], env={**base, **extra},
                                 capture_output=True, text=True, timeout=600)
            if res.returncode:
                print(res.stderr[-2000:], file=sys.stderr)
                return 1
            print(f"keys {S:6d}  {label:24s} {res.stdout.strip()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
