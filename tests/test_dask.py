"""fastattn.dask on a real distributed.LocalCluster (2 worker processes x 1 thread): every
chunking and option equals the single-process result, forward and backward; a worker killed
mid-computation is survived."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

import fastattn as fa

from helpers import package_root

da = pytest.importorskip("dask.array", reason="the dask extra is not installed")
distributed = pytest.importorskip("distributed", reason="the dask extra is not installed")
fad = pytest.importorskip("fastattn.dask")


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=":0", silence_logs=40)
    with distributed.Client(cluster) as c:
        yield c
    cluster.close()


B, HQ, HKV, L, S, E, EV = 2, 4, 2, 150, 230, 16, 8

# (query chunks, key chunks): batch, heads, length / keys, head dim
CHUNKINGS = {
    "one chunk": ((B, HQ, L, E), (B, HKV, S, E)),
    "batch": ((1, HQ, L, E), (1, HKV, S, E)),
    "heads": ((B, 2, L, E), (B, 1, S, E)),
    "queries uneven": ((B, HQ, (40, 70, 40), E), (B, HKV, S, E)),
    "keys uneven": ((B, HQ, L, E), (B, HKV, (100, 1, 129), E)),
    "everything": ((1, 2, 50, E), (2, 1, 60, E)),
}
OPTIONS = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal bottom-right": {"is_causal": True, "causal_alignment": "bottom_right"},
    "window": {"window": (30, 5)},
    "window bottom-right + causal": {"window": (40, None), "is_causal": True,
                                     "causal_alignment": "bottom_right"},
    "alibi + causal": {"alibi_slopes": "h", "is_causal": True},
    "alibi per batch": {"alibi_slopes": "bh"},
    "softcap + scale": {"softcap": 2.0, "scale": 0.7},
    "bool mask": {"attn_mask": "bool"},
    "float mask": {"attn_mask": "float", "is_causal": True},
    "sinks + causal": {"sinks": "h", "is_causal": True},
    "dropout + causal": {"dropout_p": 0.3, "rng": 17, "is_causal": True},
    "dropout + window bottom-right + alibi": {"dropout_p": 0.2, "rng": 5, "window": (20, 3),
                                              "causal_alignment": "bottom_right",
                                              "alibi_slopes": "h"},
    "dask bool mask + dropout": {"attn_mask": "dask bool", "dropout_p": 0.1, "rng": 3},
    "dask float mask + negative scale": {"attn_mask": "dask float", "scale": -0.5},
}


def _inputs(rng, dtype=np.float64):
    q = rng.standard_normal((B, HQ, L, E)).astype(dtype)
    k = rng.standard_normal((B, HKV, S, E)).astype(dtype)
    v = rng.standard_normal((B, HKV, S, EV)).astype(dtype)
    return q, k, v


def _options(rng, name, dtype=np.float64):
    kw = dict(OPTIONS[name], enable_gqa=True)
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = (0.5 ** np.arange(1, HQ + 1)).astype(dtype)
    elif kw.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = rng.random((B, HQ)).astype(dtype)
    if kw.get("sinks") == "h":
        kw["sinks"] = rng.standard_normal(HQ).astype(dtype)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = rng.random((B, 1, L, S)) > 0.3
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = rng.standard_normal((1, HQ, L, S)).astype(dtype)
    elif kw.get("attn_mask") == "dask bool":       # chunked unlike every tiling below
        kw["attn_mask"] = da.from_array(rng.random((B, HQ, L, S)) > 0.3, chunks=(1, 3, 64, 90))
    elif kw.get("attn_mask") == "dask float":
        kw["attn_mask"] = da.from_array(rng.standard_normal((L, S)).astype(dtype),
                                        chunks=(70, 100))
    return kw


def _numpy_options(kw):
    """The single-process call's options: a dask mask computed."""
    return {a: (b.compute() if isinstance(b, da.Array) else b) for a, b in kw.items()}


def _close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, what
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), what
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-10, atol=1e-12, err_msg=what)


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_forward_and_backward_equal_the_single_process_result(client, chunking, option):
    rng = np.random.default_rng(zlib.crc32(f"{chunking}|{option}".encode()))
    q, k, v = _inputs(rng)
    kw = _options(rng, option)
    qc, kc = CHUNKINGS[chunking]
    dq_, dk_, dv_ = (da.from_array(q, chunks=qc), da.from_array(k, chunks=kc),
                     da.from_array(v, chunks=kc[:3] + (EV,)))
    kw_np = _numpy_options(kw)
    want, want_lse = fa.scaled_dot_product_attention(q, k, v, return_lse=True, **kw_np)
    out, lse = fad.scaled_dot_product_attention(dq_, dk_, dv_, return_lse=True, **kw)
    assert out.chunks[:3] == dq_.chunks[:3]
    out, lse = client.compute([out, lse], sync=True)
    _close(out, want, "out")
    _close(lse, want_lse, "lse")
    g = rng.standard_normal(want.shape)
    ref = fa.scaled_dot_product_attention_backward(g, q, k, v, want, want_lse, **kw_np)
    grads = fad.scaled_dot_product_attention_backward(g, dq_, dk_, dv_, out, lse, **kw)
    assert grads[1].chunks == dk_.chunks
    assert len(grads) == len(ref) == (4 if "sinks" in kw else 3)
    for name, got, r in zip(("dq", "dk", "dv", "dsinks"), client.compute(list(grads), sync=True),
                            ref):
        _close(got, r, name)


def test_float32_within_the_tolerance_rule(client):
    from helpers import assert_close_to_reference
    from fastattn import reference

    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, np.float32)
    kw = dict(is_causal=True, enable_gqa=True)
    out = fad.scaled_dot_product_attention(da.from_array(q, chunks=(1, 2, 50, E)),
                                           da.from_array(k, chunks=(1, 1, 77, E)),
                                           da.from_array(v, chunks=(1, 1, 77, EV)), **kw)
    ref = reference.scaled_dot_product_attention(q, k, v, **kw)
    naive = reference.scaled_dot_product_attention(q, k, v, dtype=np.float32, **kw)
    got = client.compute(out, sync=True)
    assert got.dtype == np.float32
    assert_close_to_reference(got, ref, naive, np.float32)


def test_causal_graph_skips_tiles_above_the_diagonal():
    q = da.zeros((1, 1, 400, 8), chunks=(1, 1, 100, 8))
    k = da.zeros((1, 1, 400, 8), chunks=(1, 1, 100, 8))
    out = fad.scaled_dot_product_attention(q, k, k, is_causal=True)
    tiles = [key for key in dict(out.__dask_graph__()) if isinstance(key, tuple)
             and "-sdpa-tile-" in str(key[0])]
    assert len(tiles) == 10                        # 4 + 3 + 2 + 1 of the 16 tiles


def test_backward_splits_the_keys():
    """Each backward task reads one key chunk (no task needs all keys of a head), and the
    tiles the causal band leaves empty are not in the graph."""
    q = da.zeros((1, 1, 400, 8), chunks=(1, 1, 100, 8))
    k = da.zeros((1, 1, 400, 8), chunks=(1, 1, 100, 8))
    out, lse = fad.scaled_dot_product_attention(q, k, k, is_causal=True, return_lse=True)
    grads = fad.scaled_dot_product_attention_backward(q, q, k, k, out, lse, is_causal=True)
    graph = dict(grads[1].__dask_graph__())
    tiles = [task for key, task in graph.items() if isinstance(key, tuple)
             and "-sdpa-bwd-tile-" in str(key[0])]
    assert len(tiles) == 10                        # 4 + 3 + 2 + 1 of the 16 tiles
    k_blocks = {task[3] for task in tiles}         # (_tile_backward, g, q, k block, ...)
    assert len(k_blocks) == 4 and all(b[0] == k.name for b in k_blocks)
    assert grads[1].chunks == k.chunks


PICKS = {"tdq": (0,), "tdk": (1,), "tdv": (2,), "tdkv": (1, 2)}


def _kind(key):
    """What a task of fastattn.dask's graph is: the name's word before the token."""
    return str(key[0]).split("-")[-2]


def _gradient_arrays(graph, outputs):
    """The backward's keys and, for each, the gradient arrays it holds: a tile's three new
    arrays, a pick's share of its tile's, a final block's (its input's, cast in place), else a
    new one (a sum of partials, zeros); by the keys' names in fastattn.dask's graph."""
    from dask.core import get_dependencies

    bwd = {key for key in graph if isinstance(key, tuple) and "-sdpa-bwd-" in str(key[0])}
    deps = {key: sorted(d for d in get_dependencies(graph, key) if d in bwd) for key in bwd}
    arrays = {}

    def held(key):
        if key not in arrays:
            kd, ins = _kind(key), [a for d in deps[key] for a in held(d)]
            if kd == "tile":                 # the running sums it is given die with it
                arrays[key] = [(key, j) for j in range(3)]
            elif kd in PICKS:
                arrays[key] = [held(deps[key][0])[j] for j in PICKS[kd]]
            elif kd in ("dq", "dk", "dv") and ins:   # a (dk, dv) pair: dk or dv of it
                arrays[key] = [ins[kd == "dv"]] if len(ins) == 2 else ins
            else:                            # a sum of partials, or zeros
                arrays[key] = [(key, 0)]
        return arrays[key]

    for key in bwd:
        held(key)
    return deps, arrays


def _most_gradient_arrays_held(graph, outputs, rng):
    """Runs the backward's tasks in a random order the graph allows (a tile's picks, which need
    only it, right after it), releasing each key once its dependents have run as dask does, and
    returns the most gradient arrays held between two steps."""
    deps, arrays = _gradient_arrays(graph, outputs)
    users = {key: [] for key in deps}
    for key, ds in deps.items():
        for d in ds:
            users[d].append(key)
    done, alive, most = set(), set(), 0

    def run(key):
        done.add(key)
        alive.add(key)
        for d in deps[key]:
            if d not in outputs and all(u in done for u in users[d]):
                alive.discard(d)

    while len(done) < len(deps):
        ready = sorted(key for key in deps if key not in done and _kind(key) not in PICKS
                       and all(d in done for d in deps[key]))
        key = ready[rng.integers(len(ready))]
        run(key)
        for u in users[key]:
            if _kind(u) in PICKS:
                run(u)
        most = max(most, len({a for k in alive for a in arrays[k]}))
    return most


@pytest.mark.parametrize("kw", [dict(is_causal=True), {}, dict(window=(150, 0)),
                                dict(is_causal=True, causal_alignment="bottom_right")])
@pytest.mark.parametrize("lengths", [(600, 600), (300, 700)])
def test_backward_never_holds_more_than_the_gradients(kw, lengths):
    """Whatever order the scheduler picks, the backward's tasks hold no more gradient arrays
    than the gradients' own blocks (one running sum per query chunk's dq and per key chunk's dk
    and dv): a tile adds into the running sums and passes them on, so the memory does not grow
    with the number of tiles. (Trees of adds over the tiles' partials held up to every tile's
    three partials: 26-85 arrays here in these random orders, against 17-18.)"""
    from dask.core import flatten
    from dask.highlevelgraph import HighLevelGraph

    L, S = lengths
    q = da.zeros((1, 1, L, 8), chunks=(1, 1, 100, 8))
    k = da.zeros((1, 1, S, 8), chunks=(1, 1, 100, 8))
    out, lse = fad.scaled_dot_product_attention(q, k, k, return_lse=True, **kw)
    grads = fad.scaled_dot_product_attention_backward(q, q, k, k, out, lse, **kw)
    graph = dict(HighLevelGraph.merge(*(g.__dask_graph__() for g in grads)))
    outputs = {key for g in grads for key in flatten(g.__dask_keys__())}
    blocks = L // 100 + 2 * (S // 100)           # dq blocks + dk and dv blocks
    rng = np.random.default_rng(0)
    for _ in range(30):
        assert _most_gradient_arrays_held(graph, outputs, rng) <= blocks


def test_dropout_with_two_batch_dims_keeps_the_single_process_weights(client):
    rng = np.random.default_rng(21)
    q = rng.standard_normal((2, 3, 2, 40, 8))
    k = rng.standard_normal((2, 3, 2, 60, 8))
    kw = dict(dropout_p=0.4, rng=99, is_causal=True, causal_alignment="bottom_right")
    want, want_lse = fa.scaled_dot_product_attention(q, k, k, return_lse=True, **kw)
    dq_ = da.from_array(q, chunks=(1, 2, 1, 15, 8))
    dk_ = da.from_array(k, chunks=(1, 2, 1, 25, 8))
    out, lse = client.compute(list(fad.scaled_dot_product_attention(
        dq_, dk_, dk_, return_lse=True, **kw)), sync=True)
    _close(out, want, "out")
    _close(lse, want_lse, "lse")
    g = rng.standard_normal(want.shape)
    ref = fa.scaled_dot_product_attention_backward(g, q, k, k, want, want_lse, **kw)
    got = client.compute(list(fad.scaled_dot_product_attention_backward(
        g, dq_, dk_, dk_, out, lse, **kw)), sync=True)
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        _close(a, r, name)


def test_worker_killed_mid_computation_is_survived(client):
    # made on the workers, so that the graph does not carry the arrays
    gen = da.random.default_rng(11)
    shape, chunks = (8, 4, 2048, 64), (1, 1, 256, 64)
    q_d = gen.standard_normal(shape, chunks=chunks, dtype=np.float32)
    k_d = gen.standard_normal(shape, chunks=chunks, dtype=np.float32)
    q, k = client.compute([q_d, k_d], sync=True)
    want = fa.scaled_dot_product_attention(q, k, k, is_causal=True)
    out = fad.scaled_dot_product_attention(q_d, k_d, k_d, is_causal=True)
    future = client.compute(out)
    pids = client.run(os.getpid)
    time.sleep(0.3)
    assert not future.done()                       # ~1000 tasks: still running
    victim = sorted(pids.values())[0]
    os.kill(victim, signal.SIGKILL)                # the nanny restarts it; dask reruns its tasks
    got = future.result(timeout=120)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert victim not in client.run(os.getpid).values()


def test_bad_options_say_so():
    q = da.zeros((1, 1, 8, 4), chunks=(1, 1, 4, 4))
    with pytest.raises(ValueError, match="dropout_p"):
        fad.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match="rng"):
        fad.scaled_dot_product_attention_backward(q, q, q, q, q, q[..., 0], dropout_p=0.1)
    with pytest.raises(TypeError, match="attn_mask.*int64"):
        fad.scaled_dot_product_attention(q, q, q, attn_mask=da.ones((8, 8), dtype=np.int64))
    with pytest.raises(ValueError, match="attn_mask of shape \\(8, 7\\)"):
        fad.scaled_dot_product_attention(q, q, q, attn_mask=da.ones((8, 7), dtype=bool))
    with pytest.raises(ValueError, match="window"):
        fad.scaled_dot_product_attention(q, q, q, window=(1,))
    with pytest.raises(ValueError, match="heads"):
        fad.scaled_dot_product_attention(q, da.zeros((1, 3, 8, 4)), da.zeros((1, 3, 8, 4)))


def test_a_named_backend_that_cannot_run_the_tiles_says_why_at_graph_time():
    """The partial-keys backward (key chunks) and the dropout offsets: a backend listing them
    in unsupported_options raises when the graph is built, with its reason."""
    from fastattn._backends import registry

    q = da.zeros((1, 1, 8, 4), chunks=(1, 1, 4, 4))
    for name, b in registry.items():
        why = getattr(b, "unsupported_options", {})
        if not b.available:
            continue
        calls = {"delta": lambda: fad.scaled_dot_product_attention_backward(
                     q, q, q, q, q, q[..., 0], backend=name),
                 "dropout_origin": lambda: fad.scaled_dot_product_attention(
                     q, q, q, dropout_p=0.5, rng=1, backend=name)}
        for attr, call in calls.items():
            if attr in why:
                with pytest.raises(fa.BackendUnavailableError, match=re.escape(why[attr])):
                    call()
            else:
                call()                              # builds the graph


def test_import_fastattn_does_not_import_dask():
    code = "import sys, fastattn; print('dask' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=package_root(), timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_two_dimensional_inputs(client):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((n, 8)) for n in (30, 50, 50))
    want, want_lse = fa.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    out, lse = fad.scaled_dot_product_attention(da.from_array(q, chunks=(7, 8)),
                                                da.from_array(k, chunks=(20, 8)), v,
                                                is_causal=True, return_lse=True)
    assert out.shape == (30, 8) and lse.shape == (30,)
    out, lse = client.compute([out, lse], sync=True)
    _close(out, want, "out")
    _close(lse, want_lse, "lse")


def test_long_context_example_runs_small():
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "dask_long_context.py"
    if not path.exists():
        pytest.skip(f"{path} not found")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package_root()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    res = subprocess.run([sys.executable, str(path), "--tokens", "2048", "--chunk", "512"],
                         capture_output=True, text=True, cwd=package_root(), timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "max error of rows" in res.stdout and "peak memory" in res.stdout


def test_dask_bench_preset_plumbing(tmp_path, monkeypatch):
    """python -m fastattn.bench --preset dask, shrunken: every run timed forward and backward,
    the three ratios, and its files written."""
    from fastattn.bench import __main__ as bench_cli
    from fastattn.bench import dask_scaling

    res = dask_scaling.run(1, tokens=256, heads=1, head_dim=8, chunk=128)
    assert set(res["median_seconds"]) == {f"{r} / {op}" for r in dask_scaling.RUNS
                                          for op in ("forward", "backward")}
    assert all(t > 0 for t in res["median_seconds"].values())
    assert "numpy" in res["partial_keys_backward_backends"]
    for op in ("forward", "backward"):
        assert len(res["ratios"][op]) == 3 and all(r > 0 for r in res["ratios"][op].values())
    text = dask_scaling.markdown(res)
    assert "| 2 workers |" in text and "| speedup 2 workers over 1 |" in text
    monkeypatch.setattr(dask_scaling, "run", lambda rounds: res)      # the CLI's route and files
    assert bench_cli.main(["--preset", "dask", "--rounds", "1", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "dask.md").read_text() == text
    assert json.loads((tmp_path / "dask.json").read_text())["ratios"] == res["ratios"]
