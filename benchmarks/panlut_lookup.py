"""Pan-LUT lookup throughput: the fused gather vs the reference per-corner path, on one image.

Both paths of :mod:`central.panlut.lut` run the whole Pan-LUT forward (PGLUT 5-D → SDLUT 4-D × 4
rotations × 5 channels → AOLUT 5-D, dims 9/9/9) on the same Wald-protocol scene, processed whole,
with one torch thread, in one process.  The LUTs are the identity plus noise (so the cells hit are
not all on one diagonal, as a trained model's are not).  Each round times both paths, interleaved;
the fastest of ``--repeat`` rounds per path is reported as megapixels per second, then the ratio
fused / reference.  The outputs of the two paths are checked to be identical.  The lookups alone
(one PGLUT-shaped 5-D lookup, 4 outputs; one SDLUT-shaped group of 5 4-D tables, 1 output) are then
timed the same way on as many random points as the image has pixels.

    nice .venv/bin/python benchmarks/panlut_lookup.py               # retina, 1408² (the run's image)
    nice .venv/bin/python benchmarks/panlut_lookup.py --image astronaut --repeat 7

Timings on a shared machine are noisy: the minimum over interleaved rounds is the least-disturbed
pass of each path, and the ratio is the number to read.
"""

from __future__ import annotations

import argparse
import time

import torch

from central.image import largest_image
from central.panlut.data import scene
from central.panlut.lut import interpolate, interpolate_lerp
from central.panlut.model import PanLUT
from central.panlut.run import to_tensor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", default="largest", help="offline image name, or 'largest' (retina)")
    ap.add_argument("--repeat", type=int, default=5, help="timed rounds (both paths per round)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dims", type=int, nargs=3, default=(9, 9, 9), metavar=("PG", "SD", "AO"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    name = largest_image() if args.image == "largest" else args.image
    s = scene(name, 0)
    ms, pan = to_tensor(s.ms_up), to_tensor(s.pan)
    torch.manual_seed(0)
    model = PanLUT(*args.dims)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    paths = {"reference": interpolate_lerp, "fused": interpolate}
    best = {k: float("inf") for k in paths}
    outs = {}
    with torch.inference_mode():
        for k, fn in paths.items():                       # warm-up
            model.lookup = fn
            model(ms[..., :64, :64], pan[..., :64, :64])
        for r in range(args.repeat):
            for k, fn in paths.items():
                model.lookup = fn
                start = time.perf_counter()
                out = model(ms, pan)
                best[k] = min(best[k], time.perf_counter() - start)
                if r == 0:
                    outs[k] = out
    mp = s.pixels / 1e6
    same = torch.equal(outs["reference"], outs["fused"])
    diff = float((outs["reference"] - outs["fused"]).abs().max())
    print(f"image {name} {s.ref.shape[0]}x{s.ref.shape[1]} ({mp:.2f} MP), dims {tuple(args.dims)}, "
          f"{args.threads} thread(s), best of {args.repeat} interleaved rounds")
    for k in paths:
        print(f"  {k:9s}: {best[k]:.3f} s  {mp / best[k]:.2f} MP/s")
    print(f"  fused / reference throughput: {best['reference'] / best['fused']:.2f}x; "
          f"outputs identical: {same} (max |diff| {diff:.1e})")
    gen = torch.Generator().manual_seed(1)
    npx = s.pixels
    kinds = {"PGLUT/AOLUT (1 x 5-D, 4 out)": model.pg.detach(), "SDLUT (5 x 4-D, 1 out)": model.sd[0].detach()}
    with torch.inference_mode():
        for label, tables in kinds.items():
            g, n = tables.shape[0], tables.dim() - 2
            coords = [torch.rand(g, npx, generator=gen) for _ in range(n)]
            lbest = {k: float("inf") for k in paths}
            for r in range(args.repeat):
                for k, fn in paths.items():
                    start = time.perf_counter()
                    fn(tables, coords)
                    lbest[k] = min(lbest[k], time.perf_counter() - start)
            print(f"  lookup only, {label}: reference {mp / lbest['reference']:.2f} MP/s, "
                  f"fused {mp / lbest['fused']:.2f} MP/s, ratio {lbest['reference'] / lbest['fused']:.2f}x")


if __name__ == "__main__":
    main()
