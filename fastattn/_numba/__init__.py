"""Numba JIT kernels, one kernel family per module (softmax, forward, decode, backward).

Imported only by fastattn._backends.numba_, on first use: importing numba costs ~0.5 s.
"""
