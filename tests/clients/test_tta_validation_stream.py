"""The TTA learner's validation stream (issue #30): a disjoint image pool, its own noise and domain
order, selected by ``split: val`` or a seed in ``val_seeds``, reported under ``val/...`` only, so a
claim spec's tuning never reads the test stream."""

from __future__ import annotations

import numpy as np
import pytest

from clients.tta_learner import TTALearner
from fedsim import config as C
from fedsim.engine.runtime import RunSpec, get_learner
from fedsim.errors import ConfigError
from fedsim.runner import run_experiment

DOMAINS = "client.params.domains=[gaussian_noise,contrast,fog]"
SPLIT = ["client.params.test_images=300", "client.params.val_images=100", "client.params.source_epochs=1"]


def cfg_of(*overrides: str, seed: int = 0, rounds: int = 3, clients: int = 1) -> C.ExperimentConfig:
    cfg = C.load_config("lcotta", [DOMAINS, "client.params.cycles=1", "client.params.analysis_every=0",
                                   "client.params.method=source", *overrides],
                        {"rounds": rounds, "clients": clients, "seed": seed})
    cfg.tracking.enabled = False
    cfg.engine.checkpoint = False
    return cfg


def learner_of(*overrides: str, **kw) -> TTALearner:
    return get_learner(RunSpec.from_config(cfg_of(*overrides, **kw)))


def stream_rows(learner: TTALearner, pid: int = 0) -> set[int]:
    s = learner.stream(pid)
    return {int(i) for k in range(s.num_segments) for b in s.segment(k) for i in b.index}


@pytest.mark.parametrize("clients", [1, 2])
def test_validation_stream_never_overlaps_the_test_stream(clients: int) -> None:
    test = learner_of(*SPLIT, clients=clients)
    val = learner_of(*SPLIT, "client.params.val_seeds=[7]", seed=7, clients=clients)
    assert not test.is_validation and val.is_validation
    data = test.data
    test_pool, val_pool = set(test.pool_rows().tolist()), set(val.pool_rows().tolist())
    assert len(test_pool) == 200 and len(val_pool) == 100 and not test_pool & val_pool
    assert test_pool | val_pool == set(data.test_rows.tolist())  # both held out of the source's training rows
    assert not (test_pool | val_pool) & set(data.train_rows.tolist())
    # the same split whatever the run seed: no test image is ever in any run's validation pool
    assert set(learner_of(*SPLIT, "client.params.split=val", seed=3).pool_rows().tolist()) == val_pool
    test_seen = set().union(*(stream_rows(test, p) for p in range(clients)))
    val_seen = set().union(*(stream_rows(val, p) for p in range(clients)))
    assert test_seen == test_pool and val_seen == val_pool
    # own noise and own domain order (the test stream keeps the benchmark order centralised)
    assert val.stream(0).seed != learner_of(*SPLIT, seed=7, clients=clients).stream(0).seed
    if clients == 1:
        assert test.stream(0).domain_order == ["gaussian_noise", "contrast", "fog"]
        orders = {tuple(learner_of(*SPLIT, "client.params.split=val", seed=s).stream(0).domain_order) for s in range(4)}
        assert len(orders) > 1


def test_without_a_validation_pool_the_test_stream_is_unchanged() -> None:
    plain = learner_of()
    assert np.array_equal(plain.pool_rows(), plain.data.test_rows)
    assert plain.stream(0).pool_size == 500 and plain.prefix == "tta"
    with pytest.raises(ConfigError, match="val_images"):
        plain.pool_rows("val")


def test_a_validation_run_reports_val_metrics_only() -> None:
    final = run_experiment(cfg_of(*SPLIT, "client.params.split=val", "client.params.method=eata")).history.final()
    assert 0 < final["val/acc_last_cycle"] <= 1 and "val/accuracy" in final and "val/method/kept_frac" in final
    assert final["val/n"] == 3 * 100  # three blocks of the 100 validation images
    assert not [k for k in final if k.startswith("tta/")]
    test = run_experiment(cfg_of(*SPLIT, "client.params.method=eata")).history.final()  # same seed, same source
    assert test["tta/n"] == 3 * 200 and not [k for k in test if k.startswith("val/")]


@pytest.mark.parametrize("override,message", [
    ("client.params.split=val", "val_images > 0"),
    ("client.params.val_seeds=[0]", "val_images > 0"),
    ("client.params.split=train", "'test' or 'val'"),
    ("client.params.val_images=499", "val_images=499"),
])
def test_bad_validation_settings_are_one_line_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        learner_of(override).preflight()
