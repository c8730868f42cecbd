"""Pan-LUT: learnable look-up tables for pan-sharpening (arXiv:2503.23793, NeurIPS 2025 oral).

Paper: https://arxiv.org/abs/2503.23793 — code: https://github.com/CZhongnan/Pan-LUT (its released LUT
CUDA kernels and the VIF/MEF fusion networks were read by the research notes; the pan-sharpening
network definition is not in that release, so its exact wiring here is our reading [I]).

**The algorithm as the authors coded it.**  Three learnable LUT kinds, all identity-initialised and
interpolated n-linearly (bin = clamp(⌊v·(d−1)⌋, 0, d−2), 2ⁿ vertices):

* **PGLUT** (PAN-guided LUT, ``Generator5DLUT``): one 5-D LUT indexed by the 4 upsampled MS bands
  and PAN (dim 3, 6 or 9) — a channel-wise spectral mapping guided by PAN;
* **SDLUT** (spatial-details LUT): per channel a 4-D LUT indexed by the pixel's 2×2 neighbourhood
  (pixel, right, below, diagonal); four rotated variants (0°, 90°, 180°, 270°) are applied one after
  the other, each clamped to [0, 1];
* **AOLUT** (adaptive output LUT): a multi-channel LUT mapping the refined channels to the output
  bands.  The released fusion network is cat → LUT → SD0 → SD90 → SD180 → SD270 → LUT.

Headline: < 700K parameters, a 9K×9K image in < 1 ms on an RTX 2080 Ti, 15K×15K images whole on a
24 GB GPU, state of the art at full resolution.

**This package.**  :mod:`lut` — the n-linear lookup in pure PyTorch: a fused gather (one ``index_select`` of all
2ⁿ corners × tables × outputs per chunk of pixels, n batched ``torch.lerp`` reductions; gradients to
tables and coordinates), with the earlier per-corner path kept as a bit-identical reference;
:mod:`model` — PGLUT (5→4) → SDLUT ×4 rotations on the 4 bands + PAN → AOLUT (5→4);
:mod:`data` — 4-band MS (RGB + synthetic NIR) and PAN from the offline images, Wald protocol ×4;
:mod:`baselines` — Brovey, Gram-Schmidt, a PNN-style CNN; :mod:`run` — the registered ``panlut``
method (training, whole-image evaluation, CPU throughput on the largest offline image).

**Deliberate deviations / choices**

* Pure-PyTorch CPU lookups instead of the CUDA kernels (same interpolation formula; no clamping of
  the coordinates, so out-of-range inputs extrapolate the border cell like the kernels' formula).
* Wiring [I]: PGLUT outputs the 4 MS bands; PAN is carried alongside them through the SDLUT stages
  (5 channels, each with its own table per rotation) and the AOLUT (5-D, dim ``ao_dim``) maps the
  5 channels to the 4 output bands, clamped to [0, 1].  Default dims 9/9/9 → 603,612 parameters
  (< 700K); the notes' SDLUT dim 17 with separate tables per rotation would exceed 700K.
* Data are synthetic (RGB + a synthetic NIR band, PAN as a fixed spectral-weighted mean), not
  satellite imagery; only the reduced-resolution (Wald) protocol is evaluated — the paper's
  full-resolution no-reference results (QNR, D_λ, D_s) are not reproduced.
* MSE loss (PNN's; L1 gave the same Pan-LUT quality in our trials and left the CNN stuck at the
  bicubic output), Adam, a few hundred CPU steps on 64×64 crops (the paper's schedule is not
  reproduced).
* A curvature regulariser on every LUT [I: not confirmed in the paper; 3D-LUT works regularise
  their tables]: ``smooth`` × Σ_LUT mean squared second difference along each axis.  It is zero
  for affine tables (the identity init included) and spreads what visited cells learn to
  unvisited ones; without it the dim-9 5-D LUTs, trained cell by cell on 7 images, generalised
  poorly to the held-out colours (mean PSNR 30.0–30.7 dB vs 32.1 dB with it, 300–500 steps).
* The CNN baseline is PNN-style with a residual connection to the upsampled MS (see
  :mod:`baselines`); its cost is compared with oneDNN convolutions, while Pan-LUT's lookups run as
  eager PyTorch gathers — so measured CPU speed-ups understate the ratio of multiply-adds.  Both
  are timed alike in one process (1 thread, methods interleaved, fastest of ``timing_repeats``
  rounds); the fused gather is no faster than the per-corner path it replaced (see :mod:`lut`).
"""

from central.panlut import run  # noqa: F401  (registers the "panlut" method)
from central.panlut.run import PanLUTParams, check, run_panlut

__all__ = ["PanLUTParams", "check", "run_panlut"]
