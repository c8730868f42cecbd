"""The long-stream LCoTTA claim specs (issue #30): the paper's 50 cycles on each normalisation.

``lcotta_long`` (LayerNorm, the paper's ViT-like case: nothing re-normalises a test batch) and
``lcotta_long_bn`` (BatchNorm with test-batch statistics) must differ only in the model's norm layer
and the BN-1 baseline that a LayerNorm model lacks, run one domain block per round over the whole
stream, tune on the validation stream only, and read every child in some verdict.
"""

from __future__ import annotations

import pytest

from clients.tta_learner import DEFAULT_DOMAINS


def _spec(name: str):
    from fedsim.claim_protocol import read_configurations
    from fedsim.reproduce import build_config, load_claim, settings

    spec = load_claim(name)
    grid = settings(spec)
    assert read_configurations(spec, grid) == set(range(len(grid))), "a child that no verdict reads"
    return spec, [build_config(spec, setting, 0) for setting in grid]


@pytest.mark.parametrize(("name", "norm"), [("lcotta_long", "layer"), ("lcotta_long_bn", "batch")])
def test_long_stream_specs_run_the_papers_fifty_cycles_one_block_per_round(name: str, norm: str) -> None:
    spec, cfgs = _spec(name)
    for cfg in cfgs:
        assert cfg.model.params["norm"] == norm
        assert cfg.client.params["cycles"] == 50 and cfg.rounds == 50 * len(DEFAULT_DOMAINS)
        assert cfg.client.params["val_seeds"] == [100] and cfg.client.params["val_images"] > 0
    assert set(spec.tune.seeds) == {100} and spec.tune.metric.startswith("val/")
    assert not set(spec.tune.seeds) & set(spec.seeds), "tuning must not run on a test seed"
    assert set(spec.tune.methods) == {"eata", "lcotta"}


def test_the_layernorm_spec_measures_drift_against_the_unadapted_model() -> None:
    """A LayerNorm model has no test-batch statistics, so BN-1 is the source model itself: the drift
    controls compare with ``source`` (whose first-to-last-cycle drop is stream noise only)."""
    spec, cfgs = _spec("lcotta_long")
    assert {c.client.params["method"] for c in cfgs} == {"source", "tent", "eata", "lcotta"}
    drift = [c for c in spec.controls.positive if "drift" in c.name or "degrades" in c.name]
    assert len(drift) == 2 and all(c.worse == {"client.params.method": "source"} for c in drift)
    assert {c.better["client.params.method"] for c in drift} == {"tent", "eata"}
    bn = _spec("lcotta_long_bn")[0]
    assert all(c.worse == {"client.params.method": "bn_adapt"} for c in bn.controls.positive)
