"""Rehearse ``benchmarks/gpu_check.sh`` on this machine as if on the device image (no GPU needed).

On ``PYTHONPATH`` this makes every module of an installed distribution that is neither in the device
image (``image_packages.txt``, from the tool library's KINDS.md list of 2026-11-17) nor named in
``$CARRIED`` (comma list) unimportable, exactly as if it were not installed (``find_spec`` gives None,
so optional-import probes behave as there), unless it is found under a folder of ``$SITE_DIRS`` (where
the script installs the carried wheels).  At exit it prints the refused top-level modules.

    PYTHONPATH=benchmarks/emulate_image SITE_DIRS=$PWD/.gpu-site PYTHON=.venv/bin/python \\
        GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh

(On Python 3.11 swap the cp312 cffi/multiprocess wheels in .gpu-wheels for cp311 ones first.)
"""

import atexit
import importlib.metadata as md
import os
import sys
from pathlib import Path


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


_ALLOWED = {_norm(p) for p in (Path(__file__).with_name("image_packages.txt")).read_text().split()}
_ALLOWED |= {_norm(p) for p in os.environ.get("CARRIED", "").split(",") if p.strip()}
_SITES = [d for d in os.environ.get("SITE_DIRS", "").split(",") if d]
_OWN = {"fedsim", "strategies", "clients", "envs", "privacy", "central", "experiments", "benchmarks", "scripts", "tests"}
_DISTS = md.packages_distributions()
_REFUSED: set[str] = set()


def _outside_image(name: str) -> bool:
    top = name.partition(".")[0]
    if top in _OWN or top in sys.stdlib_module_names or top.startswith("_"):
        return False
    dists = [_norm(d) for d in _DISTS.get(top, [])]
    return bool(dists) and not any(d in _ALLOWED for d in dists)


class _ImageOnly:
    def __init__(self, finder: object) -> None:
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        spec = self._finder.find_spec(name, path, target)
        if spec is None or not _outside_image(name):
            return spec
        where = str(spec.origin or next(iter(spec.submodule_search_locations or []), ""))
        if any(where.startswith(site) for site in _SITES):
            return spec
        _REFUSED.add(name.partition(".")[0])
        return None

    def __getattr__(self, attr: str):
        return getattr(self._finder, attr)


sys.meta_path[:] = [_ImageOnly(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
atexit.register(lambda: _REFUSED and print(f"emulate_image: not on the image: {sorted(_REFUSED)}", file=sys.stderr))
