"""The benchmark's machinery keeps working: the smoke preset end to end, plus its bookkeeping.

No speed is asserted (the bench measures speed; a timed test would only measure the machine's
load): only that every implementation is measured or its failure recorded, that the figures are
well-formed, and that the files are written.
"""
from __future__ import annotations

import json
import sys

import pytest

import fastattn as fa
from fastattn.bench import __main__ as bench_cli
from fastattn.bench import report, runner
from fastattn.bench.cases import PRESETS, Case
from fastattn.bench.impls import unsupported_reason
from fastattn.bench.plots import write_plots


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert bench_cli.main(["--preset", "smoke", "--out", str(out)]) == 0
    with open(out / "results.json") as f:
        return out, json.load(f)


def test_smoke_records_every_implementation(smoke):
    out, data = smoke
    meta, impls = data["meta"], data["meta"]["impls"]
    for name, why in meta["implementations"].items():
        assert (name in impls) == (why == ""), (name, why)   # not run only with a reason
    assert {"fastattn-numpy", "seed-numpy"} <= set(impls)
    assert [r["case"] for r in data["records"]] == [c.name for c in PRESETS["smoke"].cases]
    for rec in data["records"]:
        assert set(rec["results"]) == set(impls), rec["case"]
        for impl, e in rec["results"].items():
            if "time_ms" in e:
                assert e["gflops"] > 0 and e["time_ms"] > 0 and e["gbytes_per_s"] > 0
                assert e["rounds"] == meta["rounds"] or e.get("error")
            else:
                assert isinstance(e.get("error"), str) and e["error"], (rec["case"], impl)
        # the NumPy implementations are always there: they must have produced numbers
        assert "time_ms" in rec["results"]["seed-numpy"], rec["results"]["seed-numpy"]
        if rec["shape"]["kind"] == "fwd":
            assert "time_ms" in rec["results"]["fastattn-numpy"]
        if "time_ms" in rec["results"].get("torch", {}):
            assert rec["results"]["torch"]["time_vs_torch"] == pytest.approx(1.0)
    assert data["probes"]["sgemm-numpy"]["gflops"] > 0
    assert data["probes"]["bandwidth"]["gbytes_per_s"] > 0
    assert meta["threads"] >= 1 and meta["versions"]["numpy"] and meta["cpu"]
    text = (out / "results.md").read_text()
    assert "| case |" in text and data["records"][0]["case"] in text


def test_smoke_writes_pngs(smoke):
    pytest.importorskip("matplotlib")
    out, _ = smoke
    for name in ("throughput.png", "memory.png", "decode.png", "backward.png"):
        head = (out / name).read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n", name


def test_plots_skipped_with_a_note_without_matplotlib(smoke, tmp_path, monkeypatch):
    _, data = smoke
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # makes `import matplotlib` fail
    written, note = write_plots(data, str(tmp_path))
    assert written == [] and "matplotlib" in note
    assert list(tmp_path.iterdir()) == []


TINY = Case("t", "fwd", 1, 2, 2, 16, 16, 8)


def _runner(impls, timeout=60.0):
    return runner.Runner(impls, threads=1, rounds=1, min_time=0.0, max_repeats=1,
                         timeout=timeout, mem_limit=0, seed_limit=1 << 30)


def test_failed_run_is_recorded_not_dropped():
    rec = _runner(["fastattn-numpy", "no-such-impl"]).run_case(TINY, 0)
    assert rec["results"]["fastattn-numpy"]["gflops"] > 0
    err = rec["results"]["no-such-impl"]["error"]
    assert err.startswith("failed") and "no-such-impl" in err


def test_timeout_is_recorded_and_larger_cases_skipped():
    r = _runner(["seed-numpy"], timeout=0.01)
    small, big = TINY, Case("t", "fwd", 1, 2, 2, 32, 32, 8)
    first = r.run_case(small, 0)["results"]["seed-numpy"]
    assert first["error"].startswith("timed out")
    second = r.run_case(big, 1)["results"]["seed-numpy"]
    assert second["error"].startswith("skipped") and "L=16" in second["error"]


def test_jit_warm_up_is_not_cut_at_the_timed_runs_timeout(monkeypatch):
    """numba's cold compile of a kernel family can outlast a timed run's timeout (the quick
    preset's 60 s): the warm-up processes get WARM_TIMEOUT_S, the timed runs their own."""
    seen = []

    def fake_worker(spec, timeout, mem_limit):
        seen.append((spec["impl"], spec["max_repeats"], timeout))
        return {"error": "failed: not run here"}

    monkeypatch.setattr(runner, "run_worker", fake_worker)
    r = _runner(["fastattn-numba", "fastattn-numpy"], timeout=60.0)
    decode = Case("t", "fwd", 1, 4, 2, 1, 256, 8)                    # L = 1: a decode
    r.warm_jit([TINY, decode])
    assert sorted(seen) == [("fastattn-numba", 1, runner.WARM_TIMEOUT_S)] * 2
    assert runner.WARM_TIMEOUT_S > 60.0
    seen.clear()
    r.run_case(TINY, 0)
    assert seen and all(t == 60.0 for _, _, t in seen)


def test_memory_cap_stops_the_run_and_is_recorded():
    spec = dict(impl="seed-numpy", threads=1, case=TINY.to_dict())
    res = runner.run_worker(spec, timeout=60.0, mem_limit=1.0)      # any process is over 1 byte
    assert res["error"].startswith("out of memory") and "cap" in res["error"]


def test_time_budget_turns_remaining_runs_into_recorded_skips():
    r = runner.Runner(["seed-numpy"], threads=1, rounds=1, min_time=0.0, max_repeats=1,
                      timeout=60.0, mem_limit=0, seed_limit=1 << 30, budget_s=1e-9)
    err = r.run_case(TINY, 0)["results"]["seed-numpy"]["error"]
    assert err.startswith("skipped") and "budget" in err


def test_case_predicted_to_time_out_is_skipped_and_cheap_cases_run_first():
    small, big = TINY, Case("t", "fwd", 1, 2, 2, 4096, 4096, 8)
    r = _runner(["seed-numpy"], timeout=10.0)
    r._rate[("t", "seed-numpy")] = (1e-3, "L=16")          # as if L=16 had run at 1 MFLOP/s
    why = r._skip_reason("seed-numpy", big)
    assert why.startswith("skipped") and "timeout" in why and "L=16" in why
    assert runner.cost_order([big, small, big]) == [1, 0, 2]


def test_seed_skipped_when_dense_scores_too_big():
    huge = Case("h", "fwd", 1, 8, 8, 65536, 65536, 64)
    why = _runner(["seed-numpy"])._skip_reason("seed-numpy", huge)
    assert why.startswith("skipped") and "GiB" in why
    assert _runner(["seed-numpy"])._skip_reason("seed-numpy", TINY) == ""


def test_backward_recorded_unavailable_when_fastattn_lacks_it(monkeypatch):
    bwd = Case("b", "bwd", 1, 2, 2, 16, 16, 8)
    monkeypatch.delattr(fa, "scaled_dot_product_attention_backward", raising=False)
    assert unsupported_reason("fastattn-numpy", bwd).startswith("not available")
    assert unsupported_reason("torch", bwd) == ""
    assert unsupported_reason("fastattn-numpy", TINY) == ""


def test_ratio_to_torch_is_median_of_per_round_ratios():
    def rounds(times):
        return [{"round": i, "times_s": [t], "first_call_s": 0.0} for i, t in enumerate(times)]
    runs = {"torch": rounds([1.0, 2.0, 4.0]), "x": rounds([2.0, 1.0, 2.0]), "y": []}
    rec = runner.summarize_case(TINY, runs, {"y": "timed out after 1 s"})
    runner.add_peak_fractions([rec], {"sgemm_peak_gflops": 100.0})
    x = rec["results"]["x"]
    # per-round ratios 2, 0.5, 0.5 -> 0.5; the ratio of medians would say 1.0
    assert x["time_vs_torch"] == pytest.approx(0.5)
    assert x["time_ms"] == pytest.approx(2000.0)
    assert x["gflops"] == pytest.approx(4 * 2 * 16 * 16 * 8 / 2.0 / 1e9)
    assert x["pct_sgemm"] == pytest.approx(100 * x["gflops"] / 100.0)
    assert rec["results"]["y"] == {"error": "timed out after 1 s"}


def test_readme_section_rewrites_only_between_markers(smoke, tmp_path):
    out, data = smoke
    readme = tmp_path / "README.md"
    before = "# title\n\n## Benchmark\n\n"
    after = "\n\n## Next\n\nkept as is\n"
    readme.write_text(before + report.START + "\nold table\n" + report.END + after)
    report.update_readme(str(readme), str(out / "results.json"))
    text = readme.read_text()
    assert text.startswith(before + report.START + "\n") and text.endswith(report.END + after)
    assert "old table" not in text and data["meta"]["command"] in text
    assert data["records"][0]["case"] in text
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        report.update_readme(str(readme), str(out / "results.json"))


def test_latency_preset_plumbing(tmp_path, monkeypatch):
    """--preset latency end to end on shrunken rows: every row has both implementations' times,
    the ratio, the limit it is compared to; the decode loop has tokens/s; files are written."""
    from fastattn.bench import latency

    monkeypatch.setattr(latency, "ROWS", (("tiny call", 1, 1, 1, 16, 8),
                                          ("GQA decode", 1, 4, 2, 40, 16)))
    monkeypatch.setattr(latency, "DRAM_BYTES", 1 << 20)
    monkeypatch.setitem(latency.LOOP, "layers", 2)
    monkeypatch.setitem(latency.LOOP, "tokens", 4)
    monkeypatch.setattr(latency, "run", lambda threads, rounds, _run=latency.run: _run(
        threads, rounds, target_ms=0.05, loop_rounds=1, rows=latency.ROWS))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{report.START}\nold\n{report.END}\n\n## next\n")
    for _ in range(2):           # the second run replaces the section the first one added
        assert bench_cli.main(["--preset", "latency", "--rounds", "2", "--threads", "1",
                               "--out", str(tmp_path), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.count(latency.START) == 1 and text.index(report.END) < text.index(latency.START)
    assert text.index(latency.END) < text.index("## next") and "| tiny call" in text
    with open(tmp_path / "latency.json") as f:
        data = json.load(f)
    assert set(data["bandwidth_gbytes_per_s"]) == {"L2", "L3", "DRAM"}
    calls, loops = data["records"][:2], data["records"][2:]
    assert [r["shape"] for r in calls] == [[1, 1, 1, 1, 16, 8], [1, 4, 2, 1, 40, 16]]
    assert len(loops) == 2
    has_torch = "torch" in calls[0]
    for r in calls:
        assert r["fastattn"]["us_per_call"] > 0 and r["limit"].endswith("bandwidth")
        assert r["limit_gbytes_per_s"] > 0 and r["fastattn"]["of_limit"] > 0
        assert "read probe" not in r
        if r["limit"] == "DRAM bandwidth":
            assert r["probe_interleaved_gbytes_per_s"] > 0
            assert r["fastattn"]["of_probe_interleaved"] > 0
        else:
            assert "of_probe_interleaved" not in r["fastattn"]
        assert ("time_vs_torch" in r) == has_torch
    for r in loops:
        assert r["fastattn"]["tokens_per_s"] > 0 and ("time_vs_torch" in r) == has_torch
    text = (tmp_path / "latency.md").read_text()
    assert "| row |" in text and "decode loop" in text and "tiny call" in text
    assert "% of the probe interleaved" in text


def test_inference_preset_plumbing(tmp_path, monkeypatch):
    """--preset inference end to end at tiny sizes: the ragged prefill, decode (contiguous,
    paged and KVCache) and append rows, each implementation's time, the ratios and the
    bandwidth shares."""
    from fastattn.bench import kvcache

    monkeypatch.setattr(kvcache, "run", lambda threads, rounds, small=False, _run=kvcache.run:
                        _run(threads, rounds, small=True))
    assert bench_cli.main(["--preset", "inference", "--rounds", "2", "--threads", "1",
                           "--out", str(tmp_path)]) == 0
    with open(tmp_path / "inference.json") as f:
        data = json.load(f)
    prefill, decode, append, dtypes = data["records"]
    has_torch = "torch padded + mask" in prefill["ms"]
    assert set(prefill["ms"]) >= {"fastattn varlen", "fastattn one by one"}
    assert prefill["varlen_vs_one_by_one"] > 0 and ("torch_vs_varlen" in prefill) == has_torch
    assert set(decode["ms"]) >= {"fastattn contiguous", "fastattn paged", "fastattn KVCache"}
    for name in ("fastattn contiguous", "fastattn paged", "fastattn KVCache"):
        assert decode[name]["gbytes_per_s"] > 0 and decode[name]["of_read_bandwidth"] > 0
    assert ("torch_vs_paged" in decode) == has_torch and decode["read_bandwidth_gbytes_per_s"] > 0
    assert ("torch_vs_KVCache" in decode) == has_torch
    assert append["largest_vs_smallest"] > 0 and len(append["ms"]) == 2
    # the cache dtypes side by side: each its own bytes (int8: codes + scales), the float32
    # row's ratio to itself is 1
    B, S, Hkv, d = 2, 64, 2, 8
    want_bytes = {"float32": B * S * Hkv * d * 8, "float16": B * S * Hkv * d * 4,
                  "int8": B * S * Hkv * (d * 2 + 8)}
    for name, nbytes in want_bytes.items():
        row = dtypes[f"{name} cache"]
        assert row["bytes_read"] == nbytes and row["gbytes_per_s"] > 0
        assert row["of_read_bandwidth"] > 0 and row["vs_float32"] > 0
    assert dtypes["float32 cache"]["vs_float32"] == 1.0
    text = (tmp_path / "inference.md").read_text()
    assert "ragged prefill" in text and "% of read bandwidth" in text and "capacity" in text
    assert "int8 cache:" in text and "the float32 cache's time" in text


def test_numpy_loop_threads_script_times_every_setting():
    """bench/numpy_loop_threads.py (a source-tree script, not part of the package) runs each
    thread setting in its own process and prints the step, product and attention times."""
    import os
    import re
    import subprocess
    from helpers import package_root
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                          "numpy_loop_threads.py")
    if not os.path.exists(script):
        pytest.skip("not a source checkout")
    res = subprocess.run([sys.executable, script, "--keys", "16", "--batch-s", "0.001",
                          "--rounds", "1"], capture_output=True, text=True, timeout=300,
                         cwd=package_root())
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("keys")]
    assert [r.split()[2] for r in rows] == ["defaults", "FASTATTN_NUM_THREADS=1",
                                           "OPENBLAS_NUM_THREADS=1"]
    for r in rows:
        times = [float(t) for t in re.findall(r"(?:step|product|attention) ([0-9.]+)", r)]
        assert len(times) == 3 and all(t > 0 for t in times), r


NUMPY_LOOP_CHILD = """
import json, sys
from fastattn.bench import numpy_loop
assert numpy_loop.main(int(sys.argv[1]), 1, sys.argv[2], small=True) == 0
assert "torch" not in sys.modules
"""


def test_numpy_loop_preset_plumbing(tmp_path):
    """--preset numpy-loop at tiny sizes, in a fresh process (the preset refuses a process that
    has torch): every row of both compiled backends has its time alone and after BLAS, the
    extra and its share of the limit; the files are written."""
    import subprocess
    from helpers import package_root
    res = subprocess.run([sys.executable, "-c", NUMPY_LOOP_CHILD, "2", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=package_root())
    assert res.returncode == 0, res.stderr[-3000:]
    with open(tmp_path / "numpy_loop.json") as f:
        data = json.load(f)
    rows = data["rows"]
    names = {r["name"] for r in rows}
    assert any(n.startswith("MHA decode") for n in names)
    assert any(n.startswith("fwd") and "causal" in n for n in names)
    assert any(n.startswith("bwd") for n in names)
    import fastattn as fa
    want = {b for b in ("cython", "numba") if fa.backends()[b].available}
    for name in names:
        assert {r["backend"] for r in rows if r["name"] == name} == want
    for r in rows:
        assert r["alone_s"] > 0 and r["after_s"] > 0 and r["share_alone"] > 0
        assert abs(r["extra"]) < 50 and r["limit"] in ("read", "gemm")
    assert data["meta"]["torch_in_process"] is False and data["meta"]["gemm_gflops"] > 0
    text = (tmp_path / "numpy_loop.md").read_text()
    assert "| row | backend | alone | after BLAS | extra |" in text


def test_numpy_loop_preset_refuses_a_process_with_torch(monkeypatch):
    from fastattn.bench import numpy_loop
    monkeypatch.setitem(sys.modules, "torch", object())
    with pytest.raises(RuntimeError, match="without torch"):
        numpy_loop.run(1, 1, small=True)
