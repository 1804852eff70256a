"""Backend choice: precedence, fallback, explicit failures, FASTATTN_REQUIRE, info."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers import package_root

import fastattn as fa
from fastattn import _backends as B
from fastattn._backends._base import Backend
from fastattn._backends.numpy_ import NumpyBackend

REAL_NUMPY = NumpyBackend()


class Recorder(Backend):
    """Stands in for a backend: serves through the NumPy code and records that it was used."""

    ops = ("forward", "softmax")

    def __init__(self, name, fail=None):
        super().__init__()
        self.name = name
        self.fail = fail
        self.calls = []

    def _load(self):
        if self.fail:
            raise ImportError(self.fail)

    def forward(self, p):
        self.calls.append("forward")
        return REAL_NUMPY.forward(p)

    def softmax_rows(self, x, keep):
        self.calls.append("softmax")
        return REAL_NUMPY.softmax_rows(x, keep)


@pytest.fixture
def fakes(monkeypatch):
    """cython and numba replaced by recorders; numba 'fails to import'."""
    cy, nb = Recorder("cython"), Recorder("numba", fail="No module named 'numba' (simulated)")
    monkeypatch.setitem(B.registry, "cython", cy)
    monkeypatch.setitem(B.registry, "numba", nb)
    monkeypatch.delenv("FASTATTN_BACKEND", raising=False)
    monkeypatch.delenv("FASTATTN_REQUIRE", raising=False)
    fa.reload_environment()          # fastattn reads the environment once, not per call
    return cy, nb


def small():
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 8)).astype(np.float32)
    return x, x, x


def test_auto_takes_first_available_and_falls_back(fakes):
    cy, nb = fakes
    fa.scaled_dot_product_attention(*small())
    assert cy.calls == ["forward"]
    assert fa.backends()["numba"].available is False
    assert "simulated" in fa.backends()["numba"].reason


def test_explicit_unavailable_backend_raises_with_reason(fakes):
    with pytest.raises(fa.BackendUnavailableError, match="numba.*simulated"):
        fa.scaled_dot_product_attention(*small(), backend="numba")


def test_auto_skips_a_failed_import(monkeypatch, fakes):
    cy, nb = fakes
    monkeypatch.setitem(B.registry, "cython", Recorder("cython", fail="broken wheel (simulated)"))
    out = fa.scaled_dot_product_attention(*small())          # falls back to numpy, no error
    assert out.shape == (1, 2, 4, 8)


def test_precedence(monkeypatch, fakes):
    cy, nb = fakes
    numpy_rec = Recorder("numpy")
    monkeypatch.setitem(B.registry, "numpy", numpy_rec)
    monkeypatch.setattr(B.registry["cython"], "forward", lambda p: (_ for _ in ()).throw(AssertionError("cython used")))

    monkeypatch.setenv("FASTATTN_BACKEND", "numpy")
    fa.reload_environment()
    assert fa.get_backend() == "numpy"
    fa.scaled_dot_product_attention(*small())
    assert numpy_rec.calls == ["forward"]

    fa.set_backend("cython")                                 # set_backend beats the env
    assert fa.get_backend() == "cython"
    with fa.use_backend("numpy"):                            # use_backend beats set_backend
        assert fa.get_backend() == "numpy"
        fa.scaled_dot_product_attention(*small())
        with pytest.raises(fa.BackendUnavailableError):      # the argument beats everything
            fa.scaled_dot_product_attention(*small(), backend="numba")
    assert numpy_rec.calls == ["forward", "forward"]
    assert fa.get_backend() == "cython"
    fa.set_backend(None)
    assert fa.get_backend() == "numpy"


def test_use_backend_does_not_leak_across_threads(fakes):
    seen = {}
    with fa.use_backend("numpy"):
        t = threading.Thread(target=lambda: seen.setdefault("other", fa.get_backend()))
        t.start()
        t.join()
        assert fa.get_backend() == "numpy"
    assert seen["other"] == "auto"


def test_unknown_names(monkeypatch):
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        fa.set_backend("gpu")
    with pytest.raises(ValueError, match="unknown backend"):
        with fa.use_backend("fast"):
            pass
    monkeypatch.setenv("FASTATTN_BACKEND", "tpu")
    fa.reload_environment()
    with pytest.raises(ValueError, match="FASTATTN_BACKEND.*tpu"):
        fa.scaled_dot_product_attention(*small())


def test_require_turns_fallback_into_error(monkeypatch, fakes):
    monkeypatch.setenv("FASTATTN_REQUIRE", "cython,numba")
    fa.reload_environment()
    with pytest.raises(fa.BackendUnavailableError, match="FASTATTN_REQUIRE lists 'numba'.*simulated"):
        fa.scaled_dot_product_attention(*small())
    monkeypatch.setenv("FASTATTN_REQUIRE", "cython")
    fa.reload_environment()
    fa.scaled_dot_product_attention(*small())


def test_softmax_dispatches_too(fakes):
    cy, _ = fakes
    fa.softmax(np.ones((2, 3)))
    assert cy.calls == ["softmax"]


def _run(code, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FASTATTN_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          timeout=120, cwd=package_root())


def test_info_cli():
    res = subprocess.run([sys.executable, "-m", "fastattn", "info"], capture_output=True, text=True,
                         timeout=120, cwd=package_root())
    assert res.returncode == 0, res.stderr
    for name in ("cython", "numba", "numpy"):
        assert f"  {name}: " in res.stdout
    assert "threads:" in res.stdout


def test_import_does_not_import_numba():
    res = _run("import sys, fastattn; print('numba' in sys.modules)")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_num_threads_env_is_validated():
    res = _run("import fastattn._config as c; c.num_threads()", FASTATTN_NUM_THREADS="zero")
    assert res.returncode != 0 and "FASTATTN_NUM_THREADS must be a positive integer" in res.stderr


def test_numba_without_a_writable_cache_still_works():
    """A read-only install with no writable home: numba finds no cache locator, and refuses
    cache=True at import. The adaptor then compiles into a private temporary cache."""
    pytest.importorskip("numba")
    code = ("import numpy as np, numba, fastattn as fa\n"
            "x = np.random.default_rng(0).random((5, 7)).astype(np.float32)\n"
            "err = np.abs(fa.softmax(x, backend='numba') - fa.softmax(x, backend='numpy')).max()\n"
            "print(fa.backends()['numba'].available, err < 1e-6, numba.config.CACHE_DIR)\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    # the only locator left is the user-provided one, and no directory is provided
    env["NUMBA_CACHE_LOCATOR_CLASSES"] = "UserProvidedCacheLocator"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300, cwd=package_root())
    assert res.returncode == 0, res.stderr
    available, close, cache_dir = res.stdout.split()
    assert available == "True" and close == "True"
    assert os.path.basename(cache_dir).startswith("fastattn-numba-cache-")


def test_source_tree_without_the_extension_says_so(tmp_path):
    """`python -m ...` from a source checkout imports the tree's fastattn/, which has no compiled
    extension unless built in place: cython's reason says so and how to get the real one."""
    import shutil

    shutil.copytree(os.path.dirname(fa.__file__), tmp_path / "fastattn",
                    ignore=shutil.ignore_patterns("_cykernels*", "__pycache__"))
    (tmp_path / "csrc").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTATTN_") and k != "PYTHONPATH"}
    # (a development install's editable finder would find the real extension for the copy too)
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
            "if '__editable__' not in getattr(f, '__module__', '')]\n"
            "import fastattn; print(fastattn.__file__); print(fastattn.backends()['cython'].reason)")
    res = subprocess.run([sys.executable, "-c", code],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    where, reason = res.stdout.splitlines()[:2]
    assert where.startswith(str(tmp_path))
    assert "source tree" in reason and "build_ext --inplace" in reason


def _keys_attended(L, S, seqlens, q_offset, left, right):
    """Brute force: the (sequence, key) pairs some query row of the sequence may attend."""
    n = 0
    for nb in seqlens:
        qo = q_offset + nb - S
        keys = set()
        for i in range(L):
            pos = i + qo
            keys.update(j for j in range(nb) if pos - left <= j <= pos + right)
        n += len(keys)
    return n


@pytest.mark.parametrize("seed", range(40))
def test_decode_bytes_count_the_keys_in_the_band_not_the_buffer(seed):
    """The decode thread choice sizes a call by the K/V its rows may attend (a preallocated
    cache passed whole with window=(0, t), per-sequence lengths, a page pool), not by the
    arrays' sizes."""
    from fastattn._backends._compiled import decode_bytes
    from fastattn._inputs import make_cache_problem, make_problem
    rng = np.random.default_rng(seed)
    # 70 sequences: past the 64 that decode_bytes counts with Python ints
    Bb, Hq, Hkv, E, Ev = 3 if seed % 2 else 70, 4, 2, 8, 5
    L, S = int(rng.integers(1, 6)), int(rng.integers(1, 60))
    left = None if rng.random() < 0.3 else int(rng.integers(0, 70))
    right = None if rng.random() < 0.3 else int(rng.integers(0, 70))
    causal = bool(rng.random() < 0.5)
    q = np.zeros((Bb, Hq, L, E), np.float32)
    k, v = np.zeros((Bb, Hkv, S, E), np.float32), np.zeros((Bb, Hkv, S, Ev), np.float32)
    align = "bottom_right" if rng.random() < 0.5 else "top_left"
    p = make_problem(q, k, v, is_causal=causal, enable_gqa=True, causal_alignment=align,
                     window=(left, right))
    b = p.band
    want = _keys_attended(L, S, [S] * Bb, b.q_offset, b.left, b.right)
    assert decode_bytes(p) == want * Hkv * (E + Ev) * 4
    seqlens = rng.integers(0, S + 1, Bb).astype(np.int32)
    p = make_cache_problem(q, k, v, seqlens=seqlens, is_causal=causal, window=(left, right))
    b = p.band
    want = _keys_attended(L, S, seqlens, b.q_offset, b.left, b.right)
    assert decode_bytes(p) == want * Hkv * (E + Ev) * 4


def test_a_small_window_of_a_large_cache_decodes_on_one_thread(monkeypatch):
    from fastattn._backends._compiled import CompiledBackend
    from fastattn._inputs import make_problem
    be = CompiledBackend()
    monkeypatch.setattr(be, "serial_decode_bytes", 1 << 20)
    q = np.zeros((1, 12, 1, 64), np.float32)
    k = np.zeros((1, 12, 4096, 64), np.float32)             # 25 MB of buffer
    assert be.decode_threads(make_problem(q, k, k), 2) == 2
    assert be.decode_threads(make_problem(q, k, k, window=(0, 100)), 2) == 1   # 101 keys



def test_numba_decodes_small_calls_on_one_thread_while_its_pool_sleeps():
    """numba's OpenMP pool waits passively (fastattn loads it so unless the user chose): a
    decode reading less than numba's serial bound runs with one thread, a larger one with all;
    with a spinning pool (torch's libgomp loaded first), every call takes every thread."""
    from fastattn import _process
    from fastattn._inputs import make_problem
    if not fa.backends()["numba"].available:
        pytest.skip("numba is not installed")
    be = B.registry["numba"]
    q = np.zeros((1, 12, 1, 64), np.float32)
    small = np.zeros((1, 12, 1024, 64), np.float32)        # 6.3 MB of K and V
    large = np.zeros((1, 12, 4096, 64), np.float32)        # 25 MB
    assert be.decode_threads(make_problem(q, large, large), 2) == 2
    want = 2 if _process.openmp_passive() is False else 1
    assert be.decode_threads(make_problem(q, small, small), 2) == want
