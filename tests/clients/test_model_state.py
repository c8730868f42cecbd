"""The learner's per-round set-up (issue #29): ``load_state`` is ``load_state_dict(strict=True)`` and
``FreshOptimiser`` is a newly built optimiser, each computing exactly what the generic path computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clients.model_state import FreshOptimiser, load_state, model_layout


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def other_state(model: nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("build", [mlp, lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))])
def test_load_state_leaves_the_model_as_load_state_dict_does(build) -> None:
    a, b = build(), build()
    state = other_state(a)
    state = {k: (v.abs().long() if v.dtype == torch.int64 else v) for k, v in state.items()}
    load_state(a, state)
    b.load_state_dict(state, strict=True)
    for (ka, va), (kb, vb) in zip(a.state_dict(keep_vars=True).items(), b.state_dict(keep_vars=True).items()):
        assert ka == kb and torch.equal(va, vb) and va.dtype == vb.dtype and va.requires_grad == vb.requires_grad
    before = [p.data_ptr() for p in a.parameters()]
    load_state(a, other_state(a, 2))
    assert [p.data_ptr() for p in a.parameters()] == before  # copied into, never replaced
    state["0.weight"].add_(1.0)
    assert not torch.equal(a.state_dict()["0.weight"], state["0.weight"])  # holds no reference to the input


@pytest.mark.parametrize("bad", ["missing", "unexpected", "shape"])
def test_load_state_raises_torchs_own_error(bad: str) -> None:
    model = mlp()
    state = other_state(model)
    if bad == "missing":
        del state["2.bias"]
    elif bad == "unexpected":
        state["9.weight"] = torch.zeros(1)
    else:
        state["2.bias"] = torch.zeros(4)
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict"):
        load_state(model, state)


def test_a_load_hook_is_honoured() -> None:
    model = mlp()
    seen: list[str] = []
    model[0].register_load_state_dict_post_hook(lambda module, keys: seen.append("hook"))
    load_state(model, other_state(model))
    assert seen == ["hook"]


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
                                  lambda ps: torch.optim.Adam(ps, lr=0.01)])
def test_a_reused_optimiser_trains_exactly_as_a_new_one(make) -> None:
    """Two rounds from the same start: momentum / Adam moments of round 1 must not leak into round 2."""
    torch.manual_seed(0)
    model, x, y = mlp(), torch.randn(8, 5), torch.randint(0, 3, (8,))
    start = {k: v.clone() for k, v in model.state_dict().items()}

    def round_with(optimiser: torch.optim.Optimizer) -> list[torch.Tensor]:
        model.load_state_dict(start)
        for _ in range(3):
            optimiser.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            optimiser.step()
        return [p.detach().clone() for p in model.parameters()]

    fresh = FreshOptimiser(make)
    first, again = round_with(fresh(model)), round_with(fresh(model))
    new = round_with(make([p for p in model.parameters() if p.requires_grad]))
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, again, new))


def test_the_optimiser_is_rebuilt_when_the_trainable_parameters_change() -> None:
    model, built = mlp(), []
    fresh = FreshOptimiser(lambda ps: built.append(len(ps)) or torch.optim.SGD(ps, lr=0.1))
    first = fresh(model)
    assert fresh(model) is first and built == [4]
    model[0].weight.requires_grad_(False)
    assert fresh(model) is not first and built == [4, 3]
    assert fresh(mlp()) is not first and built == [4, 3, 4]


# -- ModelLayout: the module walks found once, found again on any structural change -----------------


class Scaled(nn.Module):
    """Shared parameters, a persistent and a non-persistent buffer, and a nested child."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.tied = self.body[0]  # the same module twice: parameters() and modules() list it once
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


class TrainsItsOwnWay(nn.Linear):
    calls = 0

    def train(self, mode: bool = True) -> "TrainsItsOwnWay":
        TrainsItsOwnWay.calls += 1
        return super().train(mode)


def assert_layout_is_torchs(model: nn.Module) -> None:
    layout = model_layout(model)
    state = model.state_dict(keep_vars=True)
    assert list(layout.state) == list(state) and all(layout.state[k] is v for k, v in state.items())
    assert [id(p) for p in layout.params] == [id(p) for p in model.parameters()]
    assert [model, *layout.submodules] == list(model.modules())
    copies, plain = layout.host_state(model), model.state_dict()
    assert list(copies) == list(plain)
    for k, v in copies.items():
        assert torch.equal(v, plain[k]) and v.data_ptr() != plain[k].data_ptr() and not v.requires_grad


def _replace_parameter(m: nn.Module) -> None:
    m.body[2].bias = nn.Parameter(torch.zeros(3))


def _add_layer(m: nn.Module) -> None:
    m.body.add_module("3", nn.Linear(3, 3))


def _swap_child(m: nn.Module) -> None:
    m.body[2] = nn.Linear(7, 3)  # same name, same shapes, another module


def _add_buffer(m: nn.Module) -> None:
    m.body[0].register_buffer("count", torch.zeros(1, dtype=torch.long))


def _hide_buffer(m: nn.Module) -> None:
    m.register_buffer("scale", m.scale, persistent=False)


def _drop_parameter(m: nn.Module) -> None:
    m.body[2].register_parameter("bias", None)


def _save_hook(m: nn.Module) -> None:
    m.body[2]._register_state_dict_hook(lambda module, state, prefix, local: state.pop(prefix + "bias"))


def _new_class(m: nn.Module) -> None:
    m.body[2].__class__ = TrainsItsOwnWay


@pytest.mark.parametrize("change", [_replace_parameter, _add_layer, _swap_child, _add_buffer, _hide_buffer,
                                    _drop_parameter, _save_hook, _new_class])
def test_a_layout_is_found_again_after_any_structural_change(change) -> None:
    model = Scaled()
    assert_layout_is_torchs(model)
    before = model_layout(model)
    assert model_layout(model) is before  # unchanged: kept
    change(model)
    assert model_layout(model) is not before
    assert_layout_is_torchs(model)


def test_a_layout_follows_what_loading_and_training_mode_need() -> None:
    model = Scaled()
    model.body[2]._register_load_state_dict_pre_hook(lambda *args: None)
    assert model_layout(model).plain_save and not model_layout(model).plain_load
    bn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    assert not model_layout(bn).plain_load  # BatchNorm's own _load_from_state_dict

    model.eval()
    model_layout(model).train_mode(model)
    assert all(m.training for m in model.modules())
    own = nn.Sequential(TrainsItsOwnWay(2, 2))
    TrainsItsOwnWay.calls = 0
    model_layout(own).train_mode(own)  # already training, but its train() may do more: it is called
    assert TrainsItsOwnWay.calls == 1
    model.body[0].weight.requires_grad_(False)
    assert [id(p) for p in model_layout(model).trainable()] == [id(p) for p in model.parameters() if p.requires_grad]


def test_load_state_loads_into_a_parameter_that_replaced_another() -> None:
    model = mlp()
    load_state(model, other_state(model, 1))  # the layout is kept from here
    model[2].bias = nn.Parameter(torch.zeros(3))
    state = other_state(model, 2)
    load_state(model, state)
    assert torch.equal(model[2].bias.detach(), state["2.bias"])


def test_the_fresh_optimiser_takes_the_parameters_it_is_given() -> None:
    model = mlp()
    fresh = FreshOptimiser(lambda ps: torch.optim.SGD(ps, lr=0.1))
    first = fresh(model, model_layout(model).trainable())
    assert fresh(model) is first  # the same tensors, found either way
    assert [id(p) for p in first.param_groups[0]["params"]] == [id(p) for p in model.parameters()]


def test_a_kept_layout_does_not_keep_its_model_alive() -> None:
    import gc
    import weakref

    model = Scaled()
    model_layout(model)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
