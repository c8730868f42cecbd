"""minilm_lora: pretrained MiniLM-L6 + LoRA (query/value) + frozen head; federated keys; Opacus."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from envs.text import tokenize_texts
from fedsim.errors import ConfigError
from fedsim.models import build_model
from fedsim.models.minilm import LoRALinear, MiniLMLoRAClassifier, pretrained_encoder
from fedsim.registry import MODELS

MAX_LEN = 16
NUM_CLASSES = 4
LAYERS = 6  # MiniLM-L6
TEXTS = [
    "Return the socket's own address.",
    "Compute the sample variance of the data, a sequence or iterable of real numbers.",
    "Run the test case and collect the result.",
    "Create a new thread pool executor that runs calls asynchronously with a fixed number of workers.",
]


def _build(seed: int, **params) -> MiniLMLoRAClassifier:
    torch.manual_seed(seed)
    return build_model("minilm_lora", params, (MAX_LEN,), NUM_CLASSES)  # type: ignore[return-value]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(one_thread: None) -> MiniLMLoRAClassifier:
    return _build(0)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.from_numpy(tokenize_texts(TEXTS, MAX_LEN))


@pytest.fixture(scope="module")
def labels() -> torch.Tensor:
    return torch.tensor([0, 1, 2, 3])


@contextmanager
def restored(model: MiniLMLoRAClassifier) -> Iterator[MiniLMLoRAClassifier]:
    """Give the shared model back with its weights and trainable flags as they were."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        yield model
    finally:
        model.load_state_dict(state)
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
        model.zero_grad(set_to_none=True)
        model.train()


def _base_logits(model: MiniLMLoRAClassifier, ids: torch.Tensor) -> torch.Tensor:
    """The pretrained encoder (no LoRA) + mean pooling + the model's head."""
    mask = ids != 0
    hidden = pretrained_encoder()(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    w = mask.unsqueeze(-1).float()
    return model.classifier((hidden * w).sum(1) / w.sum(1))


def test_registered_with_fedsvd_defaults(model: MiniLMLoRAClassifier) -> None:
    assert MODELS.entry("minilm_lora").params is type(model.params)
    p = model.params
    assert (p.rank, p.alpha, p.targets, p.dropout, p.train_head, p.train_A) == (8, 8.0, ["query", "value"], 0.0, False, True)
    assert model.lora_scale == 1.0 and len(model.lora_layers()) == 2 * LAYERS


def test_lora_layers_wrap_query_and_value_with_peft_init(model: MiniLMLoRAClassifier) -> None:
    for name, layer in model.lora_layers().items():
        assert name.rsplit(".", 1)[-1] in {"query", "value"} and isinstance(layer, LoRALinear)
        assert layer.lora_A.weight.shape == (8, 384) and layer.lora_B.weight.shape == (384, 8)
        assert layer.lora_A.bias is None and layer.lora_B.bias is None
        assert torch.count_nonzero(layer.lora_B.weight) == 0
        bound = 1 / math.sqrt(384)  # Kaiming-uniform(a=sqrt(5)) bound
        assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.std() > bound / 3


def test_init_logits_equal_base_model_plus_head(model: MiniLMLoRAClassifier, ids: torch.Tensor) -> None:
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids), _base_logits(model, ids))
    model.train()


def test_only_lora_and_optionally_head_train(model: MiniLMLoRAClassifier) -> None:
    with restored(model):
        lora = model.trainable_keys()
        assert len(lora) == 4 * LAYERS and all(n.endswith(("lora_A.weight", "lora_B.weight")) for n in lora)
        assert model.parameter_counts()["trainable"] == 2 * LAYERS * 2 * 8 * 384
        model.set_trainable(A=False, B=True, head=False)
        assert all(n.endswith("lora_B.weight") for n in model.trainable_keys())
        model.set_trainable(A=False, B=False, head=True)
        assert model.trainable_keys() == ["classifier.weight", "classifier.bias"]


def test_sgd_on_b_changes_output_and_nothing_else(model: MiniLMLoRAClassifier, ids, labels) -> None:
    with restored(model):
        model.set_trainable(A=False, B=True, head=False)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        model.eval()  # no dropout: the change comes from B only
        start = model(ids).detach()
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(ids), labels).backward()
            opt.step()
        assert not torch.allclose(model(ids).detach(), start)
        changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
        assert changed and all(k.endswith("lora_B.weight") for k in changed)


def test_lora_delta_is_scale_b_a_x() -> None:
    torch.manual_seed(1)
    layer = LoRALinear(nn.Linear(6, 5), rank=2, alpha=6.0)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(3, 4, 6)
    delta = layer(x) - layer.base_layer(x)
    expected = 3.0 * x @ layer.lora_A.weight.T @ layer.lora_B.weight.T
    torch.testing.assert_close(delta, expected)
    torch.testing.assert_close(layer.delta_weight(), 3.0 * layer.lora_B.weight @ layer.lora_A.weight)


def test_lora_delta_on_a_model_layer(model: MiniLMLoRAClassifier) -> None:
    layer = model.lora_layers()["bert.encoder.layer.2.attention.self.value"]
    x = torch.randn(2, 5, 384)
    with restored(model), torch.no_grad():
        layer.lora_B.weight.normal_()
        delta = layer(x) - layer.base_layer(x)
        torch.testing.assert_close(delta, model.lora_scale * (x @ layer.lora_A.weight.T) @ layer.lora_B.weight.T)


def test_federated_keys_and_pairs(model: MiniLMLoRAClassifier) -> None:
    keys = model.federated_keys()
    pairs = model.lora_pairs()
    assert len(pairs) == 2 * LAYERS
    assert pairs[0] == ("bert.encoder.layer.0.attention.self.query.lora_A.weight",
                        "bert.encoder.layer.0.attention.self.query.lora_B.weight")
    assert set(keys) == {k for pair in pairs for k in pair} | {"classifier.weight", "classifier.bias"}
    with_base = model.federated_keys(include_base=True)
    extra = set(with_base) - set(keys)
    assert len(extra) == 2 * LAYERS and all(k.endswith(("query.base_layer.weight", "value.base_layer.weight")) for k in extra)
    state = model.state_dict()
    assert set(with_base) <= set(state) and with_base == [k for k in state if k in set(with_base)]


def test_federated_state_round_trips(model: MiniLMLoRAClassifier, ids: torch.Tensor) -> None:
    with restored(model):
        with torch.no_grad():
            for layer in model.lora_layers().values():
                layer.lora_B.weight.normal_(std=0.05)
        sent = {k: v.clone() for k, v in model.state_dict().items() if k in set(model.federated_keys())}
        other = _build(1)
        result = other.load_state_dict(sent, strict=False)
        assert not result.unexpected_keys and set(result.missing_keys).isdisjoint(sent)
        model.eval()
        other.eval()
        with torch.no_grad():
            assert torch.equal(model(ids), other(ids))


def test_bad_params_and_shapes() -> None:
    with pytest.raises(ConfigError, match="model.params.targets"):
        build_model("minilm_lora", {"targets": ["nope"]}, (MAX_LEN,), NUM_CLASSES)
    with pytest.raises(ConfigError, match="model.params.rank"):
        build_model("minilm_lora", {"rank": 0}, (MAX_LEN,), NUM_CLASSES)
    with pytest.raises(ConfigError, match="token-id inputs"):
        build_model("minilm_lora", {}, (1, 8, 8), NUM_CLASSES)


def test_opacus_validator_reports_no_errors(model: MiniLMLoRAClassifier) -> None:
    from opacus.validators import ModuleValidator

    assert ModuleValidator.validate(model.train(), strict=False) == []


def _private_step(mode: str, ids: torch.Tensor, labels: torch.Tensor) -> MiniLMLoRAClassifier:
    """One DP-SGD step with Opacus in ``mode`` on a fresh FFA-style model (only B trains)."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    model = _build(2, train_A=False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loader = DataLoader(TensorDataset(ids, labels), batch_size=len(labels))
    criterion = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False, grad_sample_mode=mode, criterion=criterion,
        )
        if mode == "ghost":  # ghost clipping also returns its criterion: (module, optimizer, criterion, loader)
            private, optimizer, criterion, loader = out
        else:
            private, optimizer, loader = out
        xb, yb = next(iter(loader))
        loss = criterion(private(xb), yb)
        loss.backward()
        optimizer.step()
    assert math.isfinite(loss.item())
    return model


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_opacus_dp_step_touches_only_trainable_params(mode: str, ids, labels) -> None:
    model = _private_step(mode, ids, labels)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert name.endswith("lora_B.weight") and p.grad is not None and torch.isfinite(p.grad).all()
            assert torch.count_nonzero(p) > 0  # B moved away from its zero init
        else:
            assert p.grad is None and getattr(p, "grad_sample", None) is None


def test_loading_the_encoder_does_not_touch_the_global_rng() -> None:
    """Otherwise the seeded LoRA/head init would depend on whether the encoder was cached."""
    from fedsim.models import minilm

    minilm.pretrained_encoder.cache_clear()
    torch.manual_seed(0)
    minilm.pretrained_encoder()
    after_cold = torch.rand(3)
    torch.manual_seed(0)
    minilm.pretrained_encoder()
    after_warm = torch.rand(3)
    assert torch.equal(after_cold, after_warm)
