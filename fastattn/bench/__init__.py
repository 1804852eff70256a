"""fastattn's benchmark: fastattn's backends against torch's CPU SDPA and the seed-style NumPy code.

Every measurement runs in its own process (so one implementation's thread pools, JIT caches and
memory peaks can't touch another's), implementations are interleaved round by round (so drift of
this shared, noisy machine hits all of them alike), and the figures are medians.

    python -m fastattn.bench --help
"""
