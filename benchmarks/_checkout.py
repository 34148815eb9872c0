"""What the benchmark scripts share.

- :func:`import_this_checkout`: import THIS checkout's dtshard and dtshard_kernels (works from a
  fresh clone, installed or not): the repository root goes first on ``sys.path``, even when
  another checkout is pip-installed (editable);
- :func:`free_port`: a free TCP port on 127.0.0.1 for a benchmark's process-group store.
"""

from __future__ import annotations

import os
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_this_checkout():
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import dtshard

    return dtshard


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
