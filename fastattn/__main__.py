"""`python -m fastattn info`: versions, threads and the state of every backend."""
from __future__ import annotations

import platform
import sys


def _settings_report():
    """(lines, problems) for the FASTATTN_* settings: a bad one is reported, never raised."""
    from fastattn import _backends, _config

    lines, problems = [], []
    try:
        lines.append(f"threads: {_config.num_threads()} (FASTATTN_NUM_THREADS to change)")
    except ValueError as exc:
        problems.append(str(exc))
        lines.append("threads: invalid setting, every call raises (see below)")
    try:
        lines.append(f"default backend: {_backends.get_backend()}")
    except (ValueError, TypeError) as exc:
        problems.append(str(exc))
        lines.append("default backend: invalid FASTATTN_BACKEND, every call without backend= "
                     "raises (see below)")
    required = _config.required_backends()
    if required:
        lines.append("required (FASTATTN_REQUIRE): " + ", ".join(required))
        for name in required:
            if name == "auto":
                continue
            if name not in _backends.registry:
                problems.append(f"FASTATTN_REQUIRE lists unknown backend {name!r}; choose from "
                                + ", ".join(repr(n) for n in _backends.registry)
                                + " (every call raises until it is fixed)")
            elif not _backends.registry[name].available:
                problems.append(f"FASTATTN_REQUIRE lists {name!r} but it is not available: "
                                f"{_backends.registry[name].reason} (every call raises)")
    return lines, problems


def info() -> str:
    return _info()[0]


def _info():
    import numpy as np

    import fastattn
    from fastattn import _blas_pools

    settings, problems = _settings_report()
    lines = [
        f"fastattn {fastattn.__version__}",
        f"python {platform.python_version()} on {platform.machine()} ({platform.system()})",
        f"numpy {np.__version__}",
        *settings,
        "backends:",
    ]
    for b in fastattn.backends().values():
        lines.append(f"  {b}")
    lines.extend(_blas_pools.report())
    if problems:
        lines.append("problems with the environment settings:")
        lines.extend(f"  {p}" for p in problems)
    return "\n".join(lines), problems


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] == "info":
        text, problems = _info()
        print(text)
        return 1 if problems else 0        # a bad setting fails the command (CI runs it)
    print("usage: python -m fastattn info", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
