"""What the benchmark scripts share.

- :func:`import_this_checkout`: import THIS checkout's dtshard (works from a fresh clone,
  installed or not): the repository root goes first on ``sys.path`` and ``kernels/`` is registered
  under its installed name ``dtshard_kernels``, even when another checkout is pip-installed
  (editable);
- :func:`free_port`: a free TCP port on 127.0.0.1 for a benchmark's process-group store.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_this_checkout():
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    kdir = os.path.join(ROOT, "kernels")
    if "dtshard_kernels" not in sys.modules and os.path.isfile(os.path.join(kdir, "__init__.py")):
        spec = importlib.util.spec_from_file_location(
            "dtshard_kernels", os.path.join(kdir, "__init__.py"), submodule_search_locations=[kdir])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["dtshard_kernels"] = mod
        spec.loader.exec_module(mod)
    import dtshard

    return dtshard


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
