"""hf_lora: a local HF encoder (tiny random RoBERTa) + LoRA on query/value; the paper preset end to end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fedsim.errors import ConfigError
from fedsim.models import build_model
from fedsim.models.hf_lora import HFLoRAClassifier
from fedsim.models.minilm import LoRALinear
from tests.envs.test_glue import make_sst2, make_tiny_model

MAX_LEN = 16
LAYERS = 2

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_roberta"))


def _build(path: Path, **params) -> HFLoRAClassifier:
    torch.manual_seed(0)
    return build_model("hf_lora", {"path": str(path), **params}, (MAX_LEN,), 2)  # type: ignore[return-value]


def test_lora_keys_zero_update_and_frozen_base(tiny_model) -> None:
    model = _build(tiny_model)
    pairs = model.lora_pairs()
    assert len(pairs) == 2 * LAYERS
    assert pairs[0] == ("bert.encoder.layer.0.attention.self.query.lora_A.weight",
                        "bert.encoder.layer.0.attention.self.query.lora_B.weight")
    state = model.state_dict()
    for a_key, b_key in pairs:
        assert state[a_key].shape == (8, 32) and state[b_key].shape == (32, 8)
    for layer in model.lora_layers().values():
        assert isinstance(layer, LoRALinear)
        assert torch.count_nonzero(layer.delta_weight()) == 0
    trainable = set(model.trainable_keys())
    assert trainable == {k for pair in pairs for k in pair}  # head frozen by default, base frozen
    model.set_trainable(A=False, B=True, head=False)
    assert all(k.endswith("lora_B.weight") for k in model.trainable_keys())
    assert set(model.federated_keys()) == {k for pair in pairs for k in pair} | {"classifier.weight", "classifier.bias"}
    assert model.pad_id == 1


def test_starts_at_the_pretrained_encoder_and_masks_pads(tiny_model) -> None:
    from transformers import AutoModel

    model = _build(tiny_model).eval()
    ref = AutoModel.from_pretrained(str(tiny_model), local_files_only=True).eval()
    ids = torch.tensor([[0, 5, 6, 7, 2] + [1] * (MAX_LEN - 5)])
    with torch.no_grad():
        hidden = ref(input_ids=ids, attention_mask=(ids != 1).long()).last_hidden_state[:, 0]
        expected = model.classifier(hidden)
        torch.testing.assert_close(model(ids), expected)
        for layer in model.lora_layers().values():  # query and value: a query-only change moves the
            layer.lora_B.weight.fill_(0.1)          # output of this 0.02-std random encoder by ~1e-6 only
        assert (model(ids) - expected).abs().max() > 1e-4


def test_mean_pooling_and_scale(tiny_model) -> None:
    model = _build(tiny_model, pooling="mean", rank=4, alpha=8.0)
    assert math.isclose(model.lora_scale, 2.0)
    assert model(torch.randint(3, 20, (3, MAX_LEN))).shape == (3, 2)


@pytest.mark.parametrize("params, message", [
    ({"path": "/no/such/model"}, "model.params.path: no such directory"),
    ({"path": ""}, "model.params.path is required"),
    ({"pooling": "max"}, "model.params.pooling must be one of cls, mean"),
    ({"targets": ["nonexistent"]}, "no nn.Linear named 'nonexistent'"),
])
def test_bad_params_are_one_line_errors(tiny_model, params, message) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        build_model("hf_lora", {"path": str(tiny_model), **params}, (MAX_LEN,), 2)
    assert "\n" not in str(err.value)


def test_not_a_model_dir_and_too_long_inputs(tmp_path, tiny_model) -> None:
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        build_model("hf_lora", {"path": str(tmp_path)}, (MAX_LEN,), 2)
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")  # a config with no model type
    with pytest.raises(ConfigError, match="model.params.path: cannot load a model") as err:
        build_model("hf_lora", {"path": str(tmp_path)}, (MAX_LEN,), 2)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="max_len <= 40"):
        build_model("hf_lora", {"path": str(tiny_model)}, (64,), 2)


def _paper_overrides(tmp_path: Path, tiny_model: Path) -> dict:
    root = make_sst2(tmp_path / "sst2", n_train=48, n_dev=16)
    return {"rounds": 2, "num_clients": 2, "model.params.path": str(tiny_model), "data.params.root": str(root),
            "data.params.max_len": MAX_LEN, "client.batch_size": 8, "client.local_steps": 2,
            "privacy.max_physical_batch_size": 8, "strategy.fraction_train": 1.0,
            "engine.threads_per_client": 1, "engine.checkpoint": False, "data.partition.name": "iid"}


def test_paper_preset_resolves_tokenizer_from_model_path(tmp_path, tiny_model) -> None:
    from fedsim.api import experiment_config

    cfg = experiment_config("fedsvd_paper", _paper_overrides(tmp_path, tiny_model))
    assert cfg.data.params["tokenizer"] == str(tiny_model)
    assert (cfg.model.name, cfg.strategy.name, cfg.privacy.epsilon) == ("hf_lora", "fedsvd", 6.0)


def test_paper_preset_without_paths_is_a_one_line_error() -> None:
    from fedsim.api import run

    with pytest.raises(ConfigError, match="data.params.root must name") as err:
        run("fedsvd_paper", {"rounds": 1})
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parallel
def test_paper_preset_runs_end_to_end_with_dp(tmp_path, tiny_model, in_tmp) -> None:
    from fedsim.api import run

    summary = run("fedsvd_paper", _paper_overrides(tmp_path, tiny_model), eps=3.0)
    final = summary.history.final()
    assert math.isfinite(final["eval/accuracy"]) and math.isfinite(final["eval/loss"])
    assert 0.0 <= final["eval/accuracy"] <= 1.0
    assert 0.0 < final["privacy/epsilon_max"] <= 3.0 + 1e-6  # DP-SGD ran, calibrated to the target ε
    assert len(summary.history.series("eval/accuracy")) >= 2


def test_paper_claim_spec_sweeps_the_lora_baselines_at_three_epsilons() -> None:
    from fedsim.reproduce import load_claim

    spec = load_claim("fedsvd_paper")
    assert spec.experiment == "fedsvd_paper"
    assert spec.grid["eps"] == [1, 3, 6]
    assert set(spec.grid["strategy.name"]) == {"fedsvd", "ffa_lora", "fedavg_lora", "flora", "fedex_lora"}


def test_reproduce_fedsvd_at_paper_scale_is_the_paper_setting() -> None:
    from fedsim.reproduce import build_config, load_claim, settings

    spec = load_claim("fedsvd", scale="paper", extra_overrides=["model.params.path=/models/roberta-large",
                                                                 "data.params.root=/data/glue/SST-2"])
    runs = settings(spec)
    assert len(runs) == 15 and spec.seeds == [0, 1, 2, 3, 4]
    cfg = build_config(spec, next(r for r in runs if r["strategy.name"] == "ffa_lora" and r["eps"] == 1), seed=0)
    assert (cfg.rounds, cfg.num_clients, cfg.strategy.fraction_train, cfg.client.local_steps) == (100, 6, 0.5, 10)
    assert (cfg.client.optimizer, cfg.client.lr, cfg.client.batch_size) == ("sgd", 0.5, 128)
    assert (cfg.privacy.epsilon, cfg.privacy.delta, cfg.privacy.max_grad_norm) == (1.0, 1e-5, 2.0)
    assert (cfg.model.params["rank"], cfg.model.params["alpha"], cfg.model.params["targets"]) == (8, 8.0, ["query", "value"])
    assert cfg.data.params["tokenizer"] == "/models/roberta-large" and cfg.data.params["root"] == "/data/glue/SST-2"
    assert (cfg.strategy.name, cfg.data.partition.name, cfg.data.partition.alpha) == ("ffa_lora", "dirichlet", 0.5)


def test_loading_the_encoder_prints_no_load_report(tmp_path, capfd) -> None:
    from fedsim.models.hf_lora import local_encoder

    folder = make_tiny_model(tmp_path / "m")  # saved with a pooler that hf_lora does not load
    capfd.readouterr()
    local_encoder(str(folder))
    out, err = capfd.readouterr()
    assert "pooler" not in out + err and "Loading weights" not in out + err
