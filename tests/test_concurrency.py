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
    """The compiled backends' OpenMP workers sleep between calls instead of spinning on a core
    that other work needs. Spinning (libgomp's default) costs several ms of CPU after every
    call, ~0.2-0.45 s over these 30 calls; passive waiting leaves only the calls' own work
    (~0.03 s here). A user's own OMP_WAIT_POLICY is respected, so it is removed for the child."""
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
from fastattn import _process
from fastattn._backends import registry
be = registry["cython"]
info = be.info()
torch_dir = sys.modules["torch"].__path__[0] if "torch" in sys.modules else None
own = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line
              and not (torch_dir and line.split()[-1].startswith(torch_dir))})
print(json.dumps([info.available, info.reason, _process.openmp_passive(),
                  be.serial_decode_bytes, type(be).serial_decode_bytes,
                  type(be).passive_serial_decode_bytes, own]))
"""


@pytest.mark.parametrize("case", ["own pool", "user spins", "torch first"])
def test_serial_decode_bound_follows_the_pools_wait_policy(case):
    """A sleeping OpenMP worker costs a wake-up per two-thread call (~50 us on a VM), so with
    the libgomp fastattn loads itself (passive) decode stays on the calling thread up to a
    larger size; when the pool spins (the user's GOMP_SPINCOUNT, or torch's libgomp loaded
    first and shared: a build against the system's libgomp.so.1), the smaller bound measured
    with a spinning pool holds.  A wheel that carries its own libgomp loads it beside torch's,
    passive."""
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
    available, reason, passive, bound, spin_bound, passive_bound, own = json.loads(
        res.stdout.split("\n")[-2])
    if not available:
        from conftest import required
        if "cython" in required():
            pytest.fail(f"cython required but unavailable: {reason}")
        pytest.skip(f"cython unavailable: {reason}")
    if case == "own pool" or (case == "torch first" and own):
        assert passive is True
        assert bound == max(spin_bound, passive_bound) > spin_bound
    else:
        assert passive is False
        assert bound == spin_bound
