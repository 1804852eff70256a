"""OpenBLAS's parallel regions on fastattn's pool (fastattn.share_blas_threads,
csrc/fa_blaspool.h): the same bits as OpenBLAS's own threads, every region really through the
pool, and no hang with several Python threads, a busy pool or a fork. Each case runs in a child
process (the setting is process-wide, and a hang must fail the test, not stall the suite)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import package_root

import fastattn as fa

CHILD_PRELUDE = r"""
import json, os, sys, threading
import numpy as np
import fastattn as fa
from fastattn._backends.cython_ import _import_kernels
kernels = _import_kernels()

def products(seed):
    # sizes that OpenBLAS splits over its threads (GEMM whose jobs wait for each other, GEMV)
    # and one it runs on the caller alone
    rng = np.random.default_rng(seed)
    out = []
    for n, dt in ((2048, np.float32), (700, np.float64), (257, np.float32), (8, np.float64)):
        a = rng.standard_normal((n, n)).astype(dt)
        b = rng.standard_normal((n, 3 * n // 2 + 1)).astype(dt)
        out += [a @ b, a.T @ a[:, : n // 2], b.T @ a[0], a @ a[0]]
    z = (rng.standard_normal((300, 300)) + 1j * rng.standard_normal((300, 300)))
    out.append(z @ z)
    return out
"""

SAME_BITS_CHILD = CHILD_PRELUDE + r"""
own = products(1)
q = np.random.default_rng(2).standard_normal((1, 4, 256, 32)).astype(np.float32)
att_own = fa.scaled_dot_product_attention(q, q, q, backend="cython")
shared = fa.share_blas_threads()
before = kernels._blas_callback_counts()[0]
on_pool = products(1)
regions = kernels._blas_callback_counts()[0] - before
att = fa.scaled_dot_product_attention(q, q, q, backend="cython")
from fastattn.__main__ import info
text = info()
listed = fa.blas_threads_shared()
fa.share_blas_threads(False)
mid = kernels._blas_callback_counts()[0]
again = products(1)
print(json.dumps({
    "shared": shared, "listed": listed, "regions": regions,
    "same": [bool(np.array_equal(a, b)) for a, b in zip(own, on_pool)],
    "same_after_off": [bool(np.array_equal(a, b)) for a, b in zip(own, again)],
    "regions_after_off": kernels._blas_callback_counts()[0] - mid,
    "att_ok": bool(np.array_equal(att, att_own)),
    "info": "run on fastattn's pool" in text}))
"""


def _child(code: str, *args: str, env_extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("FASTATTN_SHARE_BLAS_THREADS", None)
    env.update(env_extra or {})
    res = subprocess.run([sys.executable, "-c", code, *args], timeout=300, env=env,
                         capture_output=True, text=True, cwd=package_root())
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _need_cython():
    if "cython" not in fa.backends():
        pytest.skip("the compiled kernels are not built")


def test_blas_on_the_pool_gives_the_same_bits_and_can_be_turned_off():
    _need_cython()
    r = _child(SAME_BITS_CHILD)
    if not r["shared"]:
        pytest.skip("no OpenBLAS with a threads callback (>= 0.3.27) loaded here")
    assert r["listed"] == r["shared"]
    assert all(r["same"]), r["same"]
    # the threaded products really went through the callback (the 2048^2 GEMMs at least)
    assert r["regions"] >= (2 if len(os.sched_getaffinity(0)) >= 2 else 0)
    assert r["info"]
    assert all(r["same_after_off"]) and r["regions_after_off"] == 0
    assert r["att_ok"]


THREADS_CHILD = CHILD_PRELUDE + r"""
want = products(3)
rng = np.random.default_rng(4)
q = rng.standard_normal((2, 4, 300, 64)).astype(np.float32)
want_att = fa.scaled_dot_product_attention(q, q, q, backend="cython")
assert fa.share_blas_threads()
errors = []

def work(i):
    try:
        for _ in range(3):
            got = products(3)
            if not all(np.array_equal(a, b) for a, b in zip(want, got)):
                errors.append(f"thread {i}: BLAS result differs")
            att = fa.scaled_dot_product_attention(q, q, q, backend="cython")
            if not np.array_equal(att, want_att):
                errors.append(f"thread {i}: attention differs")
    except Exception as exc:        # noqa: BLE001  (reported to the parent)
        errors.append(repr(exc))

ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
for t in ts: t.start()
for t in ts: t.join()
print(json.dumps({"errors": errors, "counts": kernels._blas_callback_counts()}))
"""


def test_several_python_threads_with_blas_on_the_pool():
    """Four threads each doing threaded GEMMs and attention calls at once: the regions queue
    up on the pool (or on threads made for them while an attention call holds it), the
    results are those of one thread alone, nothing hangs."""
    _need_cython()
    probe = _child(CHILD_PRELUDE + "print(json.dumps({'s': fa.share_blas_threads()}))")
    if not probe["s"]:
        pytest.skip("no OpenBLAS with a threads callback (>= 0.3.27) loaded here")
    r = _child(THREADS_CHILD)
    assert r["errors"] == []
    assert r["counts"][0] > 0


FORK_CHILD = CHILD_PRELUDE + r"""
a = np.random.default_rng(5).standard_normal((1500, 1500)).astype(np.float32)
want = a @ a
fa.share_blas_threads()
a @ a                                   # the pool's helpers exist in the parent
pid = os.fork()
if pid == 0:
    ok = np.array_equal(a @ a, want) and np.array_equal(a @ a, want)
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print(json.dumps({"child": os.waitstatus_to_exitcode(status),
                  "parent": bool(np.array_equal(a @ a, want))}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_fork_with_blas_on_the_pool():
    """A forked child has none of the pool's threads: its first threaded GEMM makes them again
    (fa_pool.h) and gives the parent's bits."""
    _need_cython()
    r = _child(FORK_CHILD)
    assert r == {"child": 0, "parent": True}


def test_environment_variable_turns_it_on_at_import():
    _need_cython()
    code = CHILD_PRELUDE + "print(json.dumps({'listed': fa.blas_threads_shared()}))"
    off = _child(code)
    on = _child(code, env_extra={"FASTATTN_SHARE_BLAS_THREADS": "1"})
    assert off["listed"] == []
    if not on["listed"]:
        pytest.skip("no OpenBLAS with a threads callback (>= 0.3.27) loaded here")
    assert all("openblas" in os.path.basename(p).lower() for p in on["listed"])


BUSY_CHILD = CHILD_PRELUDE + r"""
import time
a = np.random.default_rng(6).standard_normal((2048, 2048)).astype(np.float32)
want = a @ a
assert fa.share_blas_threads()
busy = threading.Thread(target=kernels._pool_selftest, args=(2, 400, 2000.0))
busy.start()                            # the pool runs a job for ~0.4 s from another thread
time.sleep(0.05)
got = [a @ a for _ in range(3)]
busy.join()
print(json.dumps({"same": [bool(np.array_equal(g, want)) for g in got],
                  "counts": kernels._blas_callback_counts()}))
"""


def test_blas_regions_while_the_pool_is_busy_run_on_their_own_threads():
    """While another Python thread's job holds the pool, a threaded GEMM cannot have its
    helpers: its jobs run on threads made for the call (all at once, as GEMM needs)."""
    _need_cython()
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("OpenBLAS runs one thread here")
    r = _child(BUSY_CHILD)
    assert all(r["same"])
    assert r["counts"][1] >= 1, r["counts"]


SCIPY_CHILD = CHILD_PRELUDE + r"""
import scipy.linalg.blas as sb
a = np.asfortranarray(np.random.default_rng(7).standard_normal((1500, 1500)).astype(np.float32))
want = sb.sgemm(1.0, a, a)
listed = fa.share_blas_threads()
before = kernels._blas_callback_counts()[0]
got = sb.sgemm(1.0, a, a)
print(json.dumps({"listed": listed, "regions": kernels._blas_callback_counts()[0] - before,
                  "same": bool(np.array_equal(got, want))}))
"""


def test_scipy_openblas_is_shared_too():
    """SciPy wheels carry their own OpenBLAS (32-bit integers, another symbol suffix): it is
    handed to the pool as well, with the same bits."""
    _need_cython()
    pytest.importorskip("scipy")
    r = _child(SCIPY_CHILD)
    scipy_libs = [p for p in r["listed"] if "scipy.libs" in p]
    if not scipy_libs:
        pytest.skip("SciPy's BLAS here is not an OpenBLAS with a threads callback")
    assert r["same"]
    assert r["regions"] >= (1 if len(os.sched_getaffinity(0)) >= 2 else 0)
