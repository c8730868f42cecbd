"""The small vision models: norm-layer options (BatchNorm, and LayerNorm over (C, H, W) for the TTA regimes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedsim.errors import ConfigError
from fedsim.models import build_model


def _norms(model: nn.Module) -> list[type]:
    return [type(m) for m in model.modules() if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm))]


def test_norm_options_insert_one_norm_per_conv() -> None:
    plain = build_model("cnn", {"channels": [4, 8]}, (1, 28, 28), 10)
    bn = build_model("cnn", {"channels": [4, 8], "norm": "batch"}, (1, 28, 28), 10)
    ln = build_model("cnn", {"channels": [4, 8], "norm": "layer"}, (1, 28, 28), 10)
    assert _norms(plain) == [] and _norms(bn) == [nn.BatchNorm2d] * 2 and _norms(ln) == [nn.GroupNorm] * 2


def test_layer_norm_variant_normalises_each_example_over_c_h_w() -> None:
    ln = build_model("cnn", {"channels": [4], "norm": "layer"}, (1, 8, 8), 3)
    conv, norm = ln.features[0], ln.features[1]
    x = torch.randn(2, 1, 8, 8)
    h = conv(x)
    expected = nn.functional.layer_norm(h, h.shape[1:], eps=norm.eps)  # affine starts at identity
    assert torch.allclose(norm(h), expected, atol=1e-5)
    # per example: one example's output does not depend on the rest of the batch (unlike BatchNorm)
    assert torch.allclose(ln(x)[:1], ln(x[:1]), atol=1e-6)


def test_unknown_norm_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="norm must be one of"):
        build_model("cnn", {"norm": "instance"}, (1, 28, 28), 10)
