"""Calls from several Python threads at once, and fork after use: correct, never an abort or hang."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers import package_root, randn

import fastattn as fa
from fastattn import reference


def test_four_python_threads_at_once(backend):
    rng = np.random.default_rng(9)
    cases = []
    for t in range(4):
        L = 1 if t % 2 else 300                     # decode-shaped and prefill-shaped calls
        q, k, v = randn(rng, (1, 4, L, 64), np.float64), randn(rng, (1, 2, 500, 64), np.float64), randn(rng, (1, 2, 500, 64), np.float64)
        cases.append((q, k, v, reference.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
    errors = []

    def work(t):
        q, k, v, want = cases[t]
        try:
            for _ in range(5):
                got = fa.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend)
                err = float(np.abs(got - want).max())
                if err > 1e-10:
                    errors.append((t, err))
        except Exception as exc:                     # pragma: no cover - reported below
            errors.append((t, repr(exc)))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


FORK_CHILD = r"""
import os, sys
import numpy as np
import fastattn as fa
backend, child_backend = sys.argv[1], sys.argv[2]
q = np.ones((1, 8, 512, 64), np.float32)
def call(name):
    return float(fa.scaled_dot_product_attention(q, q, q, backend=name)[0, 0, 0, 0])
call(backend)                            # the parent uses its thread pools first
pid = os.fork()
if pid == 0:
    try:
        os._exit(0 if call(child_backend) == 1.0 else 3)
    except fa.BackendUnavailableError as exc:
        print(exc, file=sys.stderr, flush=True)
        os._exit(4)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _fork(parent, child):
    return subprocess.run([sys.executable, "-c", FORK_CHILD, parent, child], timeout=120,
                          capture_output=True, text=True, cwd=package_root())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_fork_after_use_completes_or_fails_clearly(backend):
    """OpenMP runtimes are not fork-safe. A child calling the same backend must finish, or get a
    clear Python error naming the fork (numba's omp pool) — never hang, never be killed."""
    res = _fork(backend, backend)
    if res.returncode == 4:
        assert backend == "numba" and "forked" in res.stderr, res.stderr[-2000:]
    else:
        assert res.returncode == 0, res.stderr[-2000:]
    # under auto, the child is served (by a backend that can run after fork)
    res = _fork(backend, "auto")
    assert res.returncode == 0, res.stderr[-2000:]


def test_user_blas_thread_setting_is_unchanged(backend):
    """Backends may hold BLAS to one thread inside their parallel regions, never after."""
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def blas_threads():
        return sorted((i["filepath"], i["num_threads"]) for i in threadpoolctl.threadpool_info()
                      if i["user_api"] == "blas")

    rng = np.random.default_rng(1)
    q = randn(rng, (2, 4, 300, 32), np.float64)
    fa.scaled_dot_product_attention(q, q, q, backend=backend)      # load every library first
    before = blas_threads()
    threads = [threading.Thread(target=lambda: [fa.scaled_dot_product_attention(q, q, q, backend=backend)
                                                for _ in range(3)]) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if backend == "numpy":
        out, lse = fa.scaled_dot_product_attention(q, q, q, backend=backend, return_lse=True)
        fa.scaled_dot_product_attention_backward(q, q, q, q, out, lse, backend=backend)
    assert blas_threads() == before


IDLE_CHILD = r"""
import os, sys, time
import numpy as np
import fastattn as fa
q = np.ones((1, 8, 64, 64), np.float32)
fa.scaled_dot_product_attention(q, q, q, backend=sys.argv[1])
assert "OMP_WAIT_POLICY" not in os.environ, "the variable leaked into the user's environment"
cpu = time.process_time()
for _ in range(30):
    fa.scaled_dot_product_attention(q, q, q, backend=sys.argv[1])
    time.sleep(0.02)
print(time.process_time() - cpu)
"""


def test_openmp_threads_wait_passively_between_calls(backend):
    """The compiled backends' workers sleep between calls instead of spinning on a core that
    other work needs. Spinning for long (libgomp's default) costs several ms of CPU after
    every call, ~0.2-0.45 s over these 30 calls; passive waiting leaves only the calls' own
    work (~0.03 s here); the cython pool's helpers spin only between the jobs of a tight loop
    (csrc/fa_pool.h), not here. A user's own OMP_WAIT_POLICY is respected, so it is removed
    for the child."""
    if backend == "numpy":
        pytest.skip("no OpenMP pool")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    res = subprocess.run([sys.executable, "-c", IDLE_CHILD, backend], timeout=300, env=env,
                         capture_output=True, text=True, cwd=package_root())
    assert res.returncode == 0, res.stderr[-2000:]
    assert float(res.stdout.split()[-1]) < 0.12, res.stdout


BOUND_CHILD = """
import json, sys
if sys.argv[1] == "torch":
    import torch                       # loads its own libgomp first, spinning by default
import fastattn as fa
from fastattn._backends import registry
be = registry["cython"]
info = be.info()
print(json.dumps([info.available, info.reason, be.serial_decode_bytes,
                  type(be).serial_decode_bytes, info.details.get("pool")]))
"""


@pytest.mark.parametrize("case", ["alone", "user spins", "torch first"])
def test_serial_decode_bound_does_not_depend_on_openmp(case):
    """The cython kernels run on their own pool (csrc/fa_pool.h), whatever OpenMP runtime is
    loaded: the bound below which decode stays on the calling thread must not change with
    torch's libgomp loaded first or the user's GOMP_SPINCOUNT (it did while the kernels ran
    on OpenMP)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if case == "user spins":
        env["GOMP_SPINCOUNT"] = "10000"
    if case == "torch first":
        pytest.importorskip("torch")
    res = subprocess.run([sys.executable, "-c", BOUND_CHILD,
                          "torch" if case == "torch first" else "-"],
                         timeout=300, env=env, capture_output=True, text=True,
                         cwd=package_root())
    assert res.returncode == 0, res.stderr[-2000:]
    available, reason, bound, class_bound, pool = json.loads(res.stdout.split("\n")[-2])
    if not available:
        from conftest import required
        if "cython" in required():
            pytest.fail(f"cython required but unavailable: {reason}")
        pytest.skip(f"cython unavailable: {reason}")
    assert pool is True
    assert bound == class_bound == 256 << 10


INFO_CHILD = """
from fastattn.__main__ import info
print(info())
"""


@pytest.mark.parametrize("timeout", [None, "4"])
def test_info_reports_spinning_blas_workers(timeout):
    """`python -m fastattn info` says whether NumPy's BLAS workers spin after each call (they
    are what an attention call right after `x @ W` competes with) and which setting stops it;
    it reads the setting the way OpenBLAS does (OPENBLAS_THREAD_TIMEOUT, an exponent)."""
    from fastattn import _blas_pools
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    if timeout is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = timeout
    res = subprocess.run([sys.executable, "-c", INFO_CHILD], timeout=300, env=env,
                         capture_output=True, text=True, cwd=package_root())
    assert res.returncode == 0, res.stderr[-2000:]
    pools = [p for p in _blas_pools.blas_pools()
             if p["internal_api"] == "openblas" and p.get("threading_layer") == "pthreads"]
    if not pools or os.cpu_count() < 2:
        pytest.skip("no multi-threaded pthreads OpenBLAS here")
    assert "blas pools beside fastattn" in res.stdout
    if timeout is None:
        assert "spin for 2**28 cycles" in res.stdout and "OPENBLAS_THREAD_TIMEOUT=4" in res.stdout
        assert "sleep at once" not in res.stdout
    else:
        assert "sleep at once (OPENBLAS_THREAD_TIMEOUT=4)" in res.stdout
        assert "spin for" not in res.stdout


@pytest.mark.parametrize("raw, exponent", [("", None), ("x", None), ("2", 4), ("4", 4),
                                           ("16", 16), ("40", 30)])
def test_openblas_spin_exponent_is_read_as_openblas_does(monkeypatch, raw, exponent):
    from fastattn import _blas_pools
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", raw)
    assert _blas_pools.openblas_spin_exponent() == exponent
