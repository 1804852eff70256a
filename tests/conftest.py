"""Shared fixtures: the backend parametrization (the tolerance rule is in helpers.py)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import fastattn as fa
from fastattn import _config

BACKENDS = list(_config.BACKEND_NAMES)


def required() -> set[str]:
    return set(_config.required_backends())


def _backend_param(name: str):
    return pytest.param(name, id=name)


@pytest.fixture(params=[_backend_param(n) for n in BACKENDS])
def backend(request):
    """Every registered backend; an unavailable one is skipped with its reason, or fails when
    FASTATTN_REQUIRE lists it (CI requires all of them)."""
    name = request.param
    info = fa.backends()[name]
    if not info.available:
        msg = f"backend {name} unavailable: {info.reason}"
        if name in required():
            pytest.fail(msg + " (required by FASTATTN_REQUIRE)")
        pytest.skip(msg)
    return name


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


@pytest.fixture(autouse=True)
def _no_backend_leak():
    """A test that sets the process-wide backend must not change the next one. Torn down after
    the test's monkeypatch has restored the environment: set_backend re-reads it, so a test's
    FASTATTN_* variables do not stay in effect either."""
    yield
    fa.set_backend(None)


def torch_or_skip():
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed (pip install torch==2.13.0 to run the torch referee)")
    return torch
