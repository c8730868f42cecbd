"""The shared image kit: offline images, splits/crops, degradations, metrics on known values, grid."""

from __future__ import annotations

import math

import numpy as np
import pytest

from central.image import (IMAGES, crops, darken, downsample, ergas, gaussian_kernel, image_grid, largest_image,
                           load_image, niqe, psnr, sam, split, ssim, upsample)
from central.image.metrics import NIQE_MIN_SIDE
from central.image.degrade import decimation_matrix, default_sigma

# -- data --------------------------------------------------------------------------------------------


def test_images_load_offline_as_float_rgb_in_unit_range() -> None:
    for name in IMAGES:
        img = load_image(name)
        assert img.dtype == np.float32 and img.ndim == 3 and img.shape[2] == 3, name
        assert 0.0 <= img.min() and img.max() <= 1.0 and img.max() > 0.5, name


def test_load_is_cached_but_returns_independent_copies() -> None:
    a = load_image("chelsea")
    a[:] = 0
    assert load_image("chelsea").max() > 0


def test_unknown_image_lists_the_names() -> None:
    with pytest.raises(ValueError, match="astronaut"):
        load_image("lena")


def test_largest_image_is_retina() -> None:
    assert largest_image() == "retina"
    assert load_image("retina").shape == (1411, 1411, 3)


def test_split_is_deterministic_disjoint_and_complete() -> None:
    tr, te = split(IMAGES, 3, seed=7)
    assert (tr, te) == split(IMAGES, 3, seed=7)
    assert len(te) == 3 and set(tr) | set(te) == set(IMAGES) and not set(tr) & set(te)
    assert [n for n in IMAGES if n in te] == te           # input order kept
    assert any(split(IMAGES, 3, seed=s)[1] != te for s in range(1, 6))
    with pytest.raises(ValueError):
        split(IMAGES, 11, seed=0)


def test_crops_are_deterministic_windows_of_the_image() -> None:
    img = load_image("coffee")
    a = crops(img, 32, 5, np.random.default_rng(3))
    b = crops(img, 32, 5, np.random.default_rng(3))
    assert a.shape == (5, 32, 32, 3) and np.array_equal(a, b)
    rng = np.random.default_rng(3)
    y, x = rng.integers(0, img.shape[0] - 31, 5)[0], rng.integers(0, img.shape[1] - 31, 5)[0]
    assert np.array_equal(a[0], img[y:y + 32, x:x + 32])
    with pytest.raises(ValueError):
        crops(img, 1000, 1, np.random.default_rng(0))


# -- degradations ------------------------------------------------------------------------------------


def test_gaussian_kernel_is_normalised_symmetric_and_peaked() -> None:
    k = gaussian_kernel(6, 1.5)
    assert k.shape == (6, 6) and math.isclose(k.sum(), 1.0)
    assert np.allclose(k, k.T) and np.allclose(k, k[::-1, ::-1])
    assert k[2, 2] == k.max() and k[0, 0] == k.min()


def test_default_sigma_gives_mtf_03_at_low_res_nyquist() -> None:
    s = default_sigma(4)
    assert math.isclose(math.exp(-2 * math.pi ** 2 * s ** 2 * (1 / 8) ** 2), 0.3, rel_tol=1e-12)


def test_downsample_of_a_constant_is_constant_of_size_h_over_f() -> None:
    img = np.full((37, 50, 4), 0.42, np.float32)
    lo = downsample(img, 4)
    assert lo.shape == (9, 12, 4) and np.allclose(lo, 0.42, atol=1e-6)


def test_downsample_interior_pixel_is_the_gaussian_window() -> None:
    rng = np.random.default_rng(0)
    img = rng.random((64, 64)).astype(np.float64)
    f, s = 4, 1.3
    m = math.ceil(3 * s)
    lo = downsample(img, f, sigma=s)
    i, j = 8, 7
    window = img[i * f - m:i * f + f + m, j * f - m:j * f + f + m]
    assert math.isclose(lo[i, j], float((gaussian_kernel(f + 2 * m, s) * window).sum()), rel_tol=1e-10)
    assert np.allclose(decimation_matrix(64, f, s).sum(axis=1), 1.0)


def test_upsample_sizes_and_constant() -> None:
    up = upsample(np.full((5, 7, 3), 0.3, np.float32), 4)
    assert up.shape == (20, 28, 3) and np.allclose(up, 0.3, atol=1e-6)
    assert upsample(np.zeros((3, 3)), 2, mode="nearest").shape == (6, 6)


def test_darken_bounds_and_noise_free_formula() -> None:
    x = np.random.default_rng(1).random((16, 16, 3)).astype(np.float32)
    d = darken(x, 0.2, 2.0, 0.05, np.random.default_rng(0))
    assert d.dtype == np.float32 and d.min() >= 0.0 and d.max() <= 1.0
    assert np.allclose(darken(x, 0.2, 2.0, 0.0, np.random.default_rng(0)), 0.2 * x.astype(np.float64) ** 2,
                       atol=1e-6)
    assert np.array_equal(d, darken(x, 0.2, 2.0, 0.05, np.random.default_rng(0)))


# -- metrics -----------------------------------------------------------------------------------------


def test_psnr_of_a_known_mse() -> None:
    ref = np.full((8, 8, 3), 0.5)
    assert math.isclose(psnr(ref, ref + 0.1), 20.0, rel_tol=1e-9)   # MSE 0.01 → 10·log10(1/0.01)


def test_ssim_is_one_on_identity_and_lower_with_noise() -> None:
    x = load_image("astronaut")[:64, :64]
    assert math.isclose(ssim(x, x), 1.0)
    assert ssim(x, np.clip(x + np.random.default_rng(0).normal(0, 0.1, x.shape), 0, 1)) < 0.9


def test_sam_of_known_angles() -> None:
    ref = np.zeros((1, 2, 3))
    est = np.zeros((1, 2, 3))
    ref[0, 0], est[0, 0] = [1, 0, 0], [1, 1, 0]          # 45°
    ref[0, 1], est[0, 1] = [0, 0, 2], [0, 0, 5]          # 0° (scaling does not change the angle)
    assert math.isclose(sam(ref, est), 22.5, rel_tol=1e-9)


def test_ergas_of_a_constant_scaling() -> None:
    ref = np.random.default_rng(0).random((10, 10, 4)) + 0.5
    # x = 1.1·ref → RMSE_b = 0.1·sqrt(mean ref_b²); ERGAS = 100/4 · sqrt(mean_b (RMSE_b/mean_b)²)
    expected = 25.0 * math.sqrt(np.mean([0.01 * np.mean(ref[..., b] ** 2) / np.mean(ref[..., b]) ** 2
                                         for b in range(4)]))
    assert math.isclose(ergas(ref, 1.1 * ref, 4), expected, rel_tol=1e-9)
    assert ergas(ref, ref, 4) == 0.0


def test_niqe_refuses_images_below_its_valid_size() -> None:
    x = load_image("china")  # 427×640
    for shape in ((256, 400), (383, 640), (427, 300)):
        with pytest.raises(ValueError, match=r"min\(H, W\) >= 384 px.*larger image size") as err:
            niqe(x[: shape[0], : shape[1]])
        assert "\n" not in str(err.value) and f"{shape[0]}×{shape[1]}" in str(err.value)
    assert NIQE_MIN_SIDE == 384 and np.isfinite(niqe(x[:384, :384]))


@pytest.mark.parametrize("name", ["china", "astronaut"])
def test_niqe_at_a_valid_size_ranks_clean_better_than_heavy_degradations(name: str) -> None:
    from scipy.ndimage import gaussian_filter
    from central.image.degrade import darken
    from central.lasq.data import resize_short_side

    x = resize_short_side(load_image(name), NIQE_MIN_SIDE)  # a downsampled natural photo, short side 384
    rng = np.random.default_rng(0)
    clean = niqe(x)
    degraded = {"noise": np.clip(x + rng.normal(0, 0.1, x.shape), 0, 1), "blur": gaussian_filter(x, (2, 2, 0)),
                "dark": darken(x, 0.12, 1.9, 0.02, rng)}  # the LASQ shifted range
    scores = {k: niqe(v) for k, v in degraded.items()}
    assert clean < 12.0 and all(v > clean + 2.0 for v in scores.values()), (clean, scores)


def test_image_grid_handles_1_3_4_bands() -> None:
    imgs = [np.zeros((8, 8)), np.zeros((8, 8, 1)), np.ones((8, 8, 3)), np.ones((8, 8, 4))]
    fig = image_grid(imgs, ["a", "b", "c", "d"])
    assert len([ax for ax in fig.axes if ax.images]) == 4
    assert fig.axes[3].images[0].get_array().shape == (8, 8, 3)
    with pytest.raises(ValueError):
        image_grid(imgs, ["a"])
