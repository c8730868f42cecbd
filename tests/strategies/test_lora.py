"""LoRA strategies: FedSVD keeps B·A and orthonormalises A; FedEx/FLoRA aggregate exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from fedsim import config as C
from fedsim.errors import ConfigError
from fedsim.contracts.strategy import StrategyContext
from strategies.lora import (A_SUFFIX, B_SUFFIX, BASE_SUFFIX, FedExLoRA, FedSVD, FedSVDParams, FLoRA, build_fedsvd,
                             lora_prefixes)

P = "enc.layer0.query."


def state(m=12, n=10, r=3, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {P + A_SUFFIX: torch.randn(r, n, generator=g), P + B_SUFFIX: torch.randn(m, r, generator=g),
            P + BASE_SUFFIX: torch.randn(m, n, generator=g), "head.weight": torch.randn(4, n, generator=g)}


def reply(sd: dict[str, torch.Tensor], n: int) -> SimpleNamespace:
    content = RecordDict({"arrays": ArrayRecord(sd), "metrics": MetricRecord({"num-examples": n})})
    return SimpleNamespace(content=content, has_error=lambda: False)


def kwargs() -> dict:
    return dict(lora_scale=0.5, root_seed=0, min_train_nodes=1, min_evaluate_nodes=0, min_available_nodes=1)


def test_fedsvd_refactor_keeps_product_and_orthonormalises_a() -> None:
    sd = state()
    out = FedSVD(svd_period=1, svd_warmup=0, **kwargs()).post_aggregate(1, dict(sd), [])
    a, b = out[P + A_SUFFIX].double(), out[P + B_SUFFIX].double()
    torch.testing.assert_close(b @ a, sd[P + B_SUFFIX].double() @ sd[P + A_SUFFIX].double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a @ a.T, torch.eye(3, dtype=torch.float64), rtol=0, atol=1e-5)
    assert torch.equal(out[P + BASE_SUFFIX], sd[P + BASE_SUFFIX]) and torch.equal(out["head.weight"], sd["head.weight"])


def test_fedsvd_schedule_follows_period_and_warmup() -> None:
    s = FedSVD(svd_period=2, svd_warmup=2, **kwargs())
    assert [r for r in range(1, 9) if s.refactor_due(r)] == [4, 6, 8]
    off = FedSVD(svd_period=0, svd_warmup=0, **kwargs())
    sd = state()
    assert not any(off.refactor_due(r) for r in range(1, 5))
    assert all(torch.equal(v, off.post_aggregate(1, dict(sd), [])[k]) for k, v in sd.items())


def test_fedex_folds_the_exact_residual_and_flora_restarts_adapters() -> None:
    clients = [state(seed=s) for s in (1, 2, 3)]
    for c in clients:  # clients share the global base; only the adapters differ
        c[P + BASE_SUFFIX] = clients[0][P + BASE_SUFFIX]
    weights = [10, 30, 60]
    replies = [reply({k: c[k] for k in (P + A_SUFFIX, P + B_SUFFIX)}, w) for c, w in zip(clients, weights)]
    p = [w / 100 for w in weights]
    target = clients[0][P + BASE_SUFFIX].double() + 0.5 * sum(
        pk * c[P + B_SUFFIX].double() @ c[P + A_SUFFIX].double() for pk, c in zip(p, clients))
    avg = dict(clients[0])
    avg[P + A_SUFFIX] = sum(pk * c[P + A_SUFFIX] for pk, c in zip(p, clients))
    avg[P + B_SUFFIX] = sum(pk * c[P + B_SUFFIX] for pk, c in zip(p, clients))
    fedex = FedExLoRA(**kwargs()).post_aggregate(1, dict(avg), replies)
    effective = fedex[P + BASE_SUFFIX].double() + 0.5 * fedex[P + B_SUFFIX].double() @ fedex[P + A_SUFFIX].double()
    torch.testing.assert_close(effective, target, rtol=1e-5, atol=1e-5)
    flora = FLoRA(**kwargs()).post_aggregate(1, dict(avg), replies)
    torch.testing.assert_close(flora[P + BASE_SUFFIX].double(), target, rtol=1e-5, atol=1e-5)
    assert not flora[P + B_SUFFIX].any()
    assert not torch.equal(flora[P + A_SUFFIX], avg[P + A_SUFFIX])
    bound = 1 / 10**0.5
    assert flora[P + A_SUFFIX].abs().max() <= bound


def test_lora_strategy_needs_a_lora_model() -> None:
    cfg = C.load_config("fedavg", ["strategy.name=fedsvd"])
    with pytest.raises(ConfigError, match="needs a LoRA model"):
        build_fedsvd(StrategyContext(cfg, cfg.num_clients), FedSVDParams())
    assert lora_prefixes(state()) == [P]


def test_the_server_refactorisation_runs_on_the_engine_device(monkeypatch) -> None:
    """engine.device reaches FedSVD's kernel: off the CPU the LoRA factors (and nothing else) go to the device,
    and the refactored ones come back to the host in the state's key order.  ``meta`` stands in for a GPU
    here (the kernel is a spy that answers with the CPU result)."""
    import strategies.lora as lora

    sd = state()
    on_cpu = lora.refactor_state(dict(sd))
    seen: list[set[str]] = []

    def kernel(factors, *, a_suffix, b_suffix):
        seen.append({str(v.device) for v in factors.values()})
        if seen[-1] == {"meta"}:  # only the factors travel
            assert set(factors) == {P + A_SUFFIX, P + B_SUFFIX}
        return {k: on_cpu[k] for k in factors}

    monkeypatch.setattr(lora, "refactor_lora_state_dict", kernel)
    monkeypatch.setattr(lora, "resolve_device", lambda name: torch.device("meta" if name == "cuda" else "cpu"))
    built = build_fedsvd(StrategyContext(C.load_config("fedsvd", ["engine.device=cuda"], {}), 6), FedSVDParams())
    assert built.device == "cuda"
    out = built.post_aggregate(1, dict(sd), [])
    assert seen == [{"meta"}]
    assert list(out) == list(sd) and all(v.device.type == "cpu" for v in out.values())
    assert all(torch.equal(out[k], on_cpu[k]) for k in sd)
    assert out["head.weight"] is sd["head.weight"]  # what is not a LoRA factor never moves
    cpu = build_fedsvd(StrategyContext(C.load_config("fedsvd", [], {}), 6), FedSVDParams())
    cpu.post_aggregate(1, dict(sd), [])
    assert seen[-1] == {"cpu"}
