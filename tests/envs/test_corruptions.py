"""The corruption families: contract, severity monotonicity, reference formulas, errors."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import envs.corruptions as C
from envs.corruptions import BENCHMARK_ORDER, CLEAN, CORRUPTIONS, corrupt
from envs.streams import digits01, mnist01
from fedsim.errors import ConfigError

#: Families that draw from the rng (the others are deterministic functions of the image).
RANDOM = {"gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "glass_blur", "motion_blur",
          "snow", "fog", "elastic_transform"}
#: At 8x8 these are only monotone end to end (see the module docstring).
DIGITS_NOT_STEPWISE = {"pixelate", "snow"}


@pytest.fixture(scope="module")
def mnist() -> np.ndarray:
    x, _ = mnist01()
    return x[np.random.default_rng(0).choice(len(x), 200, replace=False)]


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    x, _ = digits01()
    return x[np.random.default_rng(0).choice(len(x), 200, replace=False)]


@pytest.fixture(scope="module")
def rgb() -> np.ndarray:
    """150 RGB 32x32 crops of scikit-learn's two bundled photographs (offline)."""
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(0)
    crops = []
    for im in load_sample_images().images:
        for _ in range(75):
            i, j = rng.integers(0, im.shape[0] - 96), rng.integers(0, im.shape[1] - 96)
            crops.append(im[i:i + 96:3, j:j + 96:3].transpose(2, 0, 1) / 255.0)
    return np.asarray(crops, dtype=np.float32)


def _distortions(x: np.ndarray, name: str) -> list[float]:
    return [float(np.abs(corrupt(x, name, s, np.random.default_rng(s)) - x).mean()) for s in range(1, 6)]


def test_families_listed() -> None:
    assert len(CORRUPTIONS) >= 10 and len(set(CORRUPTIONS)) == len(CORRUPTIONS)
    assert BENCHMARK_ORDER == CORRUPTIONS[:14] and CLEAN not in CORRUPTIONS
    assert {"gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "motion_blur", "contrast",
            "brightness", "pixelate", "elastic_transform", "jpeg_compression", "zoom_blur"} <= set(CORRUPTIONS)


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_distortion_grows_with_severity(name: str, mnist: np.ndarray, rgb: np.ndarray, digits: np.ndarray) -> None:
    for tag, x in (("mnist 28x28", mnist), ("rgb 32x32", rgb)):
        d = _distortions(x, name)
        assert d[0] > 0 and all(b > a for a, b in zip(d, d[1:])), f"{name} on {tag}: {d}"
    d = _distortions(digits, name)
    assert d[0] > 0 and d[4] > d[0], f"{name} on digits: {d}"
    if name not in DIGITS_NOT_STEPWISE:
        assert all(b > a for a, b in zip(d, d[1:])), f"{name} on digits 8x8: {d}"


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_output_contract_and_determinism(name: str, rgb: np.ndarray, digits: np.ndarray) -> None:
    for x in (rgb[:6], digits[:6]):
        before = x.copy()
        a = corrupt(x, name, 5, np.random.default_rng(7))
        b = corrupt(x, name, 5, np.random.default_rng(7))
        assert a.shape == x.shape and a.dtype == np.float32
        assert a.min() >= 0.0 and a.max() <= 1.0 and np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)  # same rng state, same output
        np.testing.assert_array_equal(x, before)  # the input is left alone
        if name in RANDOM:
            assert not np.array_equal(a, corrupt(x, name, 5, np.random.default_rng(8)))


@pytest.mark.parametrize("name", ["defocus_blur", "gaussian_blur", "motion_blur", "zoom_blur", "glass_blur",
                                  "pixelate", "elastic_transform"])
def test_spatial_families_keep_a_constant_image(name: str) -> None:
    """Blurs and warps have kernels summing to one and sample inside the image: flat stays flat."""
    x = np.full((3, 1, 28, 28), 0.4, dtype=np.float32)
    np.testing.assert_allclose(corrupt(x, name, 5, np.random.default_rng(0)), 0.4, atol=1e-5)


def test_reference_formulas(mnist: np.ndarray) -> None:
    gray = np.full((50, 1, 28, 28), 0.5, dtype=np.float32)
    # gaussian noise: std 0.10 at severity 5 (no clipping at mid gray)
    noise = corrupt(gray, "gaussian_noise", 5, np.random.default_rng(0)) - 0.5
    assert noise.std() == pytest.approx(0.10, rel=0.03) and abs(noise.mean()) < 3e-3
    # impulse: 7 % of the values replaced by 0 or 1, half each
    imp = corrupt(gray, "impulse_noise", 5, np.random.default_rng(0))
    assert (imp != 0.5).mean() == pytest.approx(0.07, rel=0.08)
    assert (imp == 1).sum() == pytest.approx((imp == 0).sum(), rel=0.15)
    # contrast: (x - per-image mean) * c + mean, c = 0.15 at severity 5
    m = mnist.mean(axis=(2, 3), keepdims=True)
    np.testing.assert_allclose(corrupt(mnist, "contrast", 5, np.random.default_rng(0)),
                               np.clip((mnist - m) * 0.15 + m, 0, 1), atol=1e-6)
    # brightness on grayscale: x + c, c = 0.3 at severity 5
    np.testing.assert_allclose(corrupt(mnist, "brightness", 5, np.random.default_rng(0)),
                               np.clip(mnist + 0.3, 0, 1), atol=1e-6)


def test_pixelate_is_pils_box_resize(mnist: np.ndarray) -> None:
    out = corrupt(mnist[:3], "pixelate", 5, np.random.default_rng(0))  # 28 -> int(28 * 0.65) = 18 -> 28
    for img, got in zip(mnist[:3], out):
        small = Image.fromarray(img[0]).resize((18, 18), Image.Resampling.BOX)
        want = np.asarray(small.resize((28, 28), Image.Resampling.BOX))
        np.testing.assert_allclose(got[0], np.clip(want, 0, 1), atol=1e-5)


def test_jpeg_is_pils_codec(rgb: np.ndarray) -> None:
    import io

    out = corrupt(rgb[:2], "jpeg_compression", 5, np.random.default_rng(0))
    for img, got in zip(rgb[:2], out):
        buf = io.BytesIO()
        Image.fromarray(np.round(img.transpose(1, 2, 0) * 255).astype(np.uint8)).save(buf, "JPEG", quality=40)
        want = np.asarray(Image.open(io.BytesIO(buf.getvalue())), dtype=np.float32) / 255
        np.testing.assert_allclose(got, want.transpose(2, 0, 1), atol=1e-6)


@pytest.mark.parametrize("c", [(0.05, 1, 2), (0.3, 2, 2)])
def test_glass_blur_matches_the_reference_loop(c: tuple[float, int, int]) -> None:
    """The vectorised jitter equals the reference's pixel-by-pixel loop (copy semantics)."""
    x = np.random.default_rng(0).random((3, 3, 10, 9)).astype(np.float32)
    sigma, delta, passes = c
    ref = np.ascontiguousarray(C._gaussian_hw(x.copy(), sigma))
    hs, ws = np.arange(10 - delta, delta, -1), np.arange(9 - delta, delta, -1)
    off = np.random.default_rng(5).integers(-delta, delta, size=(passes, len(hs), len(ws), 3, 2), dtype=np.int8)
    for it in range(passes):
        for k in range(3):
            for i, h in enumerate(hs):
                for j, w in enumerate(ws):
                    ref[k, :, h, w] = ref[k, :, h + off[it, i, j, k, 1], w + off[it, i, j, k, 0]]
    ref = C._gaussian_hw(ref, sigma)
    np.testing.assert_allclose(C._glass_blur(x.copy(), c, np.random.default_rng(5)), ref, atol=1e-6)


def test_zoom_blur_operator_matches_direct_sum(mnist: np.ndarray) -> None:
    x = mnist[:4]
    fast = C._zoom_blur(x, (1.26, 0.01), np.random.default_rng(0))
    factors = np.arange(1, 1.26, 0.01)
    slow = (x + sum(C._zoom(x, float(z)) for z in factors)) / (len(factors) + 1)
    np.testing.assert_allclose(fast, slow, atol=1e-5)


def test_clean_domain_and_empty_batch(mnist: np.ndarray) -> None:
    np.testing.assert_array_equal(corrupt(mnist, CLEAN, 3, np.random.default_rng(0)), mnist)
    empty = np.zeros((0, 1, 28, 28), dtype=np.float32)
    assert corrupt(empty, "fog", 2, np.random.default_rng(0)).shape == (0, 1, 28, 28)


def test_bad_input_is_a_config_error(mnist: np.ndarray) -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match="unknown corruption 'frost'.*gaussian_noise.*jpeg_compression"):
        corrupt(mnist, "frost", 3, rng)
    for bad in (0, 6, 2.5, True):
        with pytest.raises(ConfigError, match="severity must be one of 1, 2, 3, 4, 5"):
            corrupt(mnist, "fog", bad, rng)
    with pytest.raises(ConfigError, match="shape"):
        corrupt(mnist[:, 0], "fog", 3, rng)
    with pytest.raises(ConfigError, match=r"in \[0, 1\]"):
        corrupt(mnist * 255, "fog", 3, rng)
