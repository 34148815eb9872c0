"""Check an installed dtshard (a wheel, not the source tree): every module imports, and the
installed version is the package's own.

    cd "$(mktemp -d)" && python /path/to/dtshard/tools/check_install.py

Run it from a folder outside the checkout (``.ci/run`` does, in a brand-new venv that installed
the built wheel): it refuses to check a ``dtshard`` imported from a source tree, since that would
hide a module the wheel forgot. It walks the packages ``dtshard`` and ``dtshard_kernels`` and
imports every module it finds; a module that fails is named with its error and the exit status
is 1. It also checks that the distribution installs exactly these two import names (in the
repository ``dtshard_kernels`` lives in ``kernels/dtshard_kernels/``; no ``kernels`` may ship).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import pkgutil
import sys
import sysconfig
import traceback

PACKAGES = ("dtshard", "dtshard_kernels")


def _installed_dir() -> str:
    return os.path.realpath(sysconfig.get_paths()["purelib"])


def main() -> int:
    failures: list[tuple[str, str]] = []
    imported = 0
    site = _installed_dir()
    for top in PACKAGES:
        try:
            package = importlib.import_module(top)
        except Exception:  # noqa: BLE001 (report every failure, then exit 1)
            failures.append((top, traceback.format_exc()))
            continue
        where = os.path.realpath(os.path.dirname(package.__file__))
        if not where.startswith(site + os.sep):
            print(f"check_install: {top} was imported from {where}, not from the installed "
                  f"site-packages ({site}); run this from a folder outside the checkout, in the "
                  "venv that installed the wheel", file=sys.stderr)
            return 1
        imported += 1
        # walk_packages imports each package to find its children; onerror collects those that fail
        names = [info.name for info in pkgutil.walk_packages(
            package.__path__, prefix=top + ".",
            onerror=lambda name: failures.append((name, traceback.format_exc())))]
        for name in names:
            try:
                importlib.import_module(name)
                imported += 1
            except Exception:  # noqa: BLE001
                failures.append((name, traceback.format_exc()))

    version = importlib.metadata.version("dtshard")
    # the distribution installs these import names and no other (never `kernels`: the repository's
    # kernels/ folder holds dtshard_kernels, and `kernels` is a different PyPI distribution's name)
    tops = {str(f).split("/", 1)[0] for f in importlib.metadata.files("dtshard") or ()
            if not str(f).split("/", 1)[0].endswith(".dist-info") and not str(f).startswith("..")}
    if tops != set(PACKAGES):
        failures.append(("the distribution's top-level names",
                         f"{sorted(tops)}, expected exactly {sorted(PACKAGES)}\n"))
    dtshard = sys.modules.get("dtshard")  # None when it failed to import (already recorded)
    if dtshard is not None and getattr(dtshard, "__version__", None) != version:
        failures.append(("dtshard.__version__",
                         f"{getattr(dtshard, '__version__', None)!r} != installed distribution {version!r}\n"))

    for name, err in failures:
        print(f"check_install: FAILED to import {name}:\n{err}", file=sys.stderr)
    print(f"check_install: {imported} modules of {', '.join(PACKAGES)} imported from {site}"
          f" (dtshard {version}); {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
