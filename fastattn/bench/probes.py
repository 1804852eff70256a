"""The machine's own limits, measured in the same run as the attention cases.

- `sgemm-numpy`, `sgemm-torch`: float32 GEMM rate (2·n³ FLOP per n×n product) through NumPy's
  BLAS and through torch's; the faster one is "the machine's sgemm peak" every GF/s is compared to.
- `bandwidth`: read bandwidth of a float32 matrix-vector product over 512 MiB (NumPy's BLAS,
  threaded): it reads every byte once, like decoding reads the KV cache, and the matrix is far
  larger than any cache.

Each probe runs in a worker process like an implementation, with the same threads.
"""
from __future__ import annotations

import importlib.util

import numpy as np

PREFIX = "probe:"
SGEMM_N = 2048
BANDWIDTH_BYTES = 512 << 20


def probes() -> list[str]:
    names = ["sgemm-numpy"]
    if importlib.util.find_spec("torch"):
        names.append("sgemm-torch")
    names.append("bandwidth")
    return [PREFIX + n for n in names]


def make_probe(name: str, threads: int, small: bool = False):
    """(call, work, unit): `work` units (FLOP or bytes) are done by one call."""
    n = 256 if small else SGEMM_N
    rng = np.random.default_rng(0)
    if name in (PREFIX + "sgemm-numpy", PREFIX + "sgemm-torch"):
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        if name.endswith("torch"):
            import torch

            torch.set_num_threads(threads)
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            return (lambda: ta @ tb), 2.0 * n ** 3, "flop"
        return (lambda: a @ b), 2.0 * n ** 3, "flop"
    if name == PREFIX + "bandwidth":
        cols = 4096
        rows = (BANDWIDTH_BYTES >> (6 if small else 0)) // (4 * cols)
        m = np.ones((rows, cols), dtype=np.float32)    # ones: pages really allocated and touched
        x = np.ones(cols, dtype=np.float32)
        return (lambda: m @ x), float(m.nbytes), "byte"
    raise ValueError(f"unknown probe {name!r}")
