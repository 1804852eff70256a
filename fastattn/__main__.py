"""`python -m fastattn info`: versions, threads and the state of every backend."""
from __future__ import annotations

import platform
import sys


def info() -> str:
    import numpy as np

    import fastattn
    from fastattn import _config

    lines = [
        f"fastattn {fastattn.__version__}",
        f"python {platform.python_version()} on {platform.machine()} ({platform.system()})",
        f"numpy {np.__version__}",
        f"threads: {_config.num_threads()} (FASTATTN_NUM_THREADS to change)",
        f"default backend: {fastattn.get_backend()}",
        "backends:",
    ]
    for b in fastattn.backends().values():
        lines.append(f"  {b}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] == "info":
        print(info())
        return 0
    print("usage: python -m fastattn info", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
