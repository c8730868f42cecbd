"""The contracts' own invariants: every wire key is defined once with a distinct value, both sides of
an algorithm read the same constant, and a learner without an optional capability refuses it clearly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedsim.contracts import Learner, NodeContext, wire
from fedsim.contracts.transforms import apply_transforms, register_transform, transform


def wire_keys() -> dict[str, str]:
    return {k: v for k, v in vars(wire).items() if k.isupper() and isinstance(v, str)}


def test_wire_keys_are_distinct() -> None:
    keys = wire_keys()
    assert len(keys) >= 15
    assert len(set(keys.values())) == len(keys), "two wire constants share one key"


def test_both_sides_of_an_algorithm_use_the_wire_constants() -> None:
    """The strategy that writes a key and the learner that reads it hold the very same constant."""
    import clients.supervised as learner
    import strategies.fedphoenix as phoenix
    import strategies.lora as lora

    assert learner.PROXIMAL_MU is wire.PROXIMAL_MU and learner.LORA_TRAIN_A is wire.LORA_TRAIN_A
    assert lora.A_SUFFIX is wire.LORA_A_SUFFIX and lora.B_SUFFIX is wire.LORA_B_SUFFIX
    assert phoenix.PHOENIX_SEED is wire.PHOENIX_SEED and phoenix.TRANSFORM_KEY is wire.TRANSFORM_KEY


class Bare(Learner):
    def init_arrays(self):  # pragma: no cover - not called
        return {}

    def train(self, arrays, ctx):  # pragma: no cover
        raise AssertionError

    def evaluate(self, arrays, ctx):  # pragma: no cover
        raise AssertionError


def test_optional_capabilities_refuse_with_a_reason() -> None:
    bare = Bare(cfg=None, params=None)  # type: ignore[arg-type]
    ctxs = [NodeContext(0, 2, 1, 0), NodeContext(1, 2, 1, 0)]
    assert bare.cohort_refusal(ctxs, auto=True) == "learner Bare does not train cohorts"
    with pytest.raises(NotImplementedError, match="does not train cohorts"):
        bare.train_cohort([{}, {}], ctxs, chunk=2)
    with pytest.raises(NotImplementedError, match="no sample-level privacy plan"):
        bare.privacy_plan(0)
    assert not bare.supports_dp


def test_builtin_transform_loads_on_first_use_and_unknown_is_an_error() -> None:
    from fedsim.contracts.wire import PHOENIX

    assert transform(PHOENIX).__module__ == "algorithms.fedphoenix"
    with pytest.raises(ValueError, match=r"unknown model transform 'nope'; known: .*phoenix-reset"):
        apply_transforms(nn.Linear(2, 2), {wire.TRANSFORM_KEY: "nope"})


def test_a_registered_transform_is_applied_in_order() -> None:
    seen: list[str] = []

    @register_transform("test-scale")
    def _scale(model: nn.Module, config) -> dict[str, float]:
        seen.append("scale")
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(float(config["factor"]))
        return {"scaled": 1.0}

    model = nn.Linear(2, 1, bias=False)
    before = model.weight.detach().clone()
    out = apply_transforms(model, {wire.TRANSFORM_KEY: ["test-scale", "test-scale"], "factor": 2.0})
    assert seen == ["scale", "scale"] and out == {"scaled": 1.0}
    assert torch.equal(model.weight, before * 4)
    assert apply_transforms(model, {}) == {}
