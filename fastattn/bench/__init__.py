"""fastattn's benchmark: fastattn's backends against torch's CPU SDPA, jax and the seed NumPy code.

Every measurement runs in its own process (so one implementation's thread pools, JIT caches and
memory peaks can't touch another's), implementations are interleaved round by round (so drift of
this shared, noisy machine hits all of them alike), and the figures are medians.

    python -m fastattn.bench --help                     # run (quick preset by default)
    python -m fastattn.bench.report --readme README.md  # README section from bench/results/

Modules: cases (shapes, presets, FLOP counts), impls (the implementations), probes (the
machine's sgemm rate and bandwidth), worker (one measurement in one process), runner (processes,
interleaving, summaries), report (markdown), plots (PNGs), machine (what it ran on), progress.
"""
