"""HeavyWater / SimplexWater / Red-Green / Gumbel: codes, OT sampling, detection calibration, the run."""

from __future__ import annotations

import math

import numpy as np
import ot
import pytest

from fedsim.central_runner import run_central
from central.watermark.experiment import (Streams, detection_curves, dirichlet_pool, empirical_threshold, entropy,
                                          repetition, score_streams, synthetic_streams)
from central.watermark.method import WatermarkParams, check
from central.watermark.schemes import (SCHEMES, HeavyWater, OTScheme, RedGreen, SchemeConfig, SimplexWater,
                                       make_scheme, top_p_support, tv)
from fedsim import config as C
from fedsim.cli import main
from fedsim.errors import ConfigError

V = 64
V_NULL = 1024
CFG = SchemeConfig(dtype="float64")


@pytest.fixture(scope="module")
def mid_pool() -> np.ndarray:
    return dirichlet_pool(np.random.default_rng(0), V, 1.0, 2.0, 24)


@pytest.fixture(scope="module")
def null_streams():
    """Unwatermarked text over a large vocabulary: i.i.d. uniform tokens (few repeated contexts, so a
    single key's scores are not dominated by a handful of (previous token, token) pairs)."""
    tokens = np.random.default_rng(1).integers(0, V_NULL, size=(3000, 101))
    return Streams(tokens[:, 1:], tokens[:, :-1])


def test_simplex_scores_are_inner_products_of_binary_codes_mod_2() -> None:
    scheme = SimplexWater(300, key=7, cfg=CFG)
    n = scheme.bits
    assert n == 9 and scheme.side_size == 2**9 - 1
    rng = np.random.default_rng(0)
    x, s = rng.integers(0, 300, 500), rng.integers(1, 2**n, 500)
    bits = lambda v: np.array([int(c) for c in format(int(v), f"0{n}b")])  # noqa: E731  (the authors' bin())
    expected = np.array([(bits(a) @ bits(b)) % 2 for a, b in zip(x, s)])
    assert np.array_equal(scheme.score(x, s), expected)
    # side information lives in {1, ..., 2^n - 1}
    sides = scheme.side(np.arange(300))
    assert sides.min() >= 1 and sides.max() <= 2**n - 1


def test_top_p_keeps_the_smallest_top_set_and_renormalises() -> None:
    P = np.array([[0.5, 0.3, 0.15, 0.05], [0.9995, 0.0003, 0.0001, 0.0001]])
    idx, a = top_p_support(P, 0.9)
    assert list(idx[0][a[0] > 0]) == [0, 1, 2] and np.allclose(a[0][:3], np.array([0.5, 0.3, 0.15]) / 0.95)
    assert list(idx[1][a[1] > 0]) == [0] and a[1][0] == 1.0
    assert np.allclose(a.sum(1), 1.0)


@pytest.mark.parametrize("name", ["simplex", "heavy"])
def test_batched_sinkhorn_is_pots_sinkhorn(name: str, mid_pool) -> None:
    """Same plan (hence the same conditionals) and the same iteration count as ot.sinkhorn."""
    scheme = make_scheme(name, V, 3, CFG)
    assert isinstance(scheme, OTScheme)
    c = scheme.couple(mid_pool[:6])
    S = np.arange(1, scheme.side_size + 1)
    for i in range(6):
        keep = c.a[i] > 0
        idx, a = c.idx[i][keep], c.a[i][keep]
        M = scheme.cost(scheme.score(idx[:, None], S[None, :]))
        plan, log = ot.sinkhorn(a, np.full(len(S), 1 / len(S)), M, CFG.reg, numItermax=CFG.max_iter,
                                stopThr=CFG.stop_thr, log=True)
        mine = c.u[i][keep][:, None] * np.exp(-M / CFG.reg)
        assert np.allclose(mine / mine.sum(0), plan / plan.sum(0), atol=1e-10)
        assert c.iters[i] == log["niter"]


@pytest.mark.parametrize("name", ["simplex", "heavy"])
def test_ot_sampling_is_distortion_free_up_to_sinkhorn_tolerance(name: str, mid_pool) -> None:
    scheme = make_scheme(name, V, 3, CFG)
    assert isinstance(scheme, OTScheme)
    c = scheme.couple(mid_pool, with_average=True)
    assert c.average is not None and tv(c.a, c.average).max() < 1e-3
    # and the sampler really draws from those conditionals: pooled over many contexts -> P
    P = np.repeat(mid_pool[:1], 40_000, axis=0)
    cc = scheme.couple(P[:1]).take(np.zeros(len(P), dtype=int))
    draws = scheme.sample_coupled(cc, np.random.default_rng(5).integers(0, 10**6, len(P)), np.random.default_rng(6))
    freq = np.bincount(draws, minlength=V) / len(P)
    base = np.zeros(V)
    base[cc.idx[0]] = cc.a[0]
    assert tv(freq, base) < 0.02
    # the conditionals themselves are far from P (that is the watermark)
    cond = scheme.conditional(c.take(np.zeros(8, dtype=int)), np.arange(1, 9))
    assert tv(cond, c.a[[0] * 8]).min() > 0.05


def test_tilt_trades_distortion_for_detection(mid_pool) -> None:
    from dataclasses import replace

    plain, tilted = SimplexWater(V, 3, CFG), SimplexWater(V, 3, replace(CFG, tilt=0.5))
    c0, c1 = plain.couple(mid_pool, with_average=True), tilted.couple(mid_pool, with_average=True)
    assert tv(c0.a, c0.average).max() < 1e-3 < tv(c1.a, c1.average).mean()
    s = np.arange(1, plain.side_size + 1)
    rows = np.zeros(len(s), dtype=int)

    def mean_score(scheme: SimplexWater, c) -> float:
        return float((scheme.conditional(c.take(rows), s) * scheme.score(c.idx[rows], s[:, None])).sum(1).mean())

    assert mean_score(tilted, c1) > mean_score(plain, c0) + 0.02  # mean f under the watermark rises


def test_red_green_distorts_and_gumbel_does_not(mid_pool) -> None:
    rng = np.random.default_rng(0)
    rg = make_scheme("redgreen", V, 3, CFG)
    gb = make_scheme("gumbel", V, 3, CFG)
    assert isinstance(rg, RedGreen)
    assert tv(mid_pool[:4], rg.average(mid_pool[:4], 512, rng)).min() > 0.02
    filtered = gb.filtered(mid_pool[:4])  # type: ignore[attr-defined]
    assert tv(filtered, gb.average(mid_pool[:4], 4096, rng)).max() < 0.01  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", SCHEMES)
def test_false_positive_rate_is_nominal_on_unwatermarked_sequences(name: str, null_streams) -> None:
    """Empirical FPR of "p <= 1%" within a 3-sigma binomial band (HeavyWater: exact MC p-value)."""
    scheme = make_scheme(name, V_NULL, 11, CFG)
    T, n = 100, len(null_streams.tokens)
    scores = scheme.token_scores(null_streams.tokens, null_streams.prev)
    if isinstance(scheme, HeavyWater):
        p = scheme.pvalue_mc(null_streams.tokens, scores, [T], 400, np.random.default_rng(0))[:, 0]
    else:
        p = scheme.pvalue(scores[:, :T].sum(1), T)
    fpr, band = (p <= 0.01).mean(), 3 * math.sqrt(0.01 * 0.99 / n)
    assert abs(fpr - 0.01) < band + 0.002, fpr  # + discreteness of the count statistics


def test_watermarked_sequences_score_far_above_null(null_streams) -> None:
    pool = dirichlet_pool(np.random.default_rng(0), V_NULL, 1.0, 2.0, 64)
    for name in SCHEMES:
        scheme = make_scheme(name, V_NULL, 11, CFG)
        c = scheme.couple(pool) if isinstance(scheme, OTScheme) else None
        wm = synthetic_streams(scheme, pool, c, 40, 100, np.random.default_rng(2))
        z_wm = scheme.z(scheme.token_scores(wm.tokens, wm.prev).sum(1), 100)
        z_null = scheme.z(scheme.token_scores(null_streams.tokens[:1000], null_streams.prev[:1000]).sum(1), 100)
        assert np.median(z_wm) > 4 and z_wm.min() > np.quantile(z_null, 0.99), name
        assert abs(np.mean(z_null)) < 0.15, name
        # a wrong key sees no watermark
        other = make_scheme(name, V_NULL, 12, CFG)
        assert abs(np.median(other.z(other.token_scores(wm.tokens, wm.prev).sum(1), 100))) < 1.5, name


def test_same_key_and_seed_give_the_same_tokens(mid_pool) -> None:
    def gen(name: str, key: int, seed: int) -> np.ndarray:
        scheme = make_scheme(name, V, key, CFG)
        c = scheme.couple(mid_pool) if isinstance(scheme, OTScheme) else None
        return synthetic_streams(scheme, mid_pool, c, 8, 30, np.random.default_rng(seed)).tokens

    for name in SCHEMES:
        assert np.array_equal(gen(name, 5, 0), gen(name, 5, 0)), name
        assert not np.array_equal(gen(name, 5, 0), gen(name, 6, 0)), name


def test_dedup_scores_each_context_token_pair_once() -> None:
    """A text cycling through two tokens repeats one score 50 times: without dedup that alone gives
    huge |z| for many keys; with dedup only the 2 distinct (prev, token) pairs count."""
    tokens = np.tile([5, 9], (40, 50))
    prev = np.concatenate([np.full((40, 1), 9), tokens[:, :-1]], axis=1)
    for name in SCHEMES:
        zs_all, zs_dedup = [], []
        for key in range(40):
            scheme = make_scheme(name, V, key, CFG)
            zs_all.append(score_streams(scheme, Streams(tokens[:1], prev[:1]), dedup=False).z[0, -1])
            d = score_streams(scheme, Streams(tokens[:1], prev[:1]), dedup=True)
            assert d.count[0, -1] == 2
            zs_dedup.append(d.z[0, -1])
        assert np.mean(np.abs(zs_all)) > 3 * np.mean(np.abs(zs_dedup)), name


def test_repetition_counts_repeated_pairs_within_a_sequence_and_distinct_pairs_over_all() -> None:
    # sequence 0 loops (0,1) (1,2) (2,1) (1,2) (2,1) (1,2): 3 of its 6 pairs are repeats;
    # sequence 1 has 6 distinct pairs, one of them, (1, 2), also in sequence 0 (not a repeat within it)
    tokens = np.array([[1, 2, 1, 2, 1, 2], [2, 4, 5, 6, 7, 8]])
    prev = np.array([[0, 1, 2, 1, 2, 1], [1, 2, 4, 5, 6, 7]])
    first = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=bool)
    nll = np.where(first, 2.0, 0.1)  # repeats are cheap for the model
    r = repetition(Streams(tokens, prev, {"nll": nll}))
    assert r["repeated_pairs"] == pytest.approx(3 / 12)
    assert r["distinct_2"] == pytest.approx(8 / 12)  # (0,1) (1,2) (2,1) + 5 new pairs of sequence 1
    assert r["ppl_first_pairs"] == pytest.approx(math.exp(2.0))  # the repeats do not lower it
    assert math.exp(nll.mean()) < r["ppl_first_pairs"]
    # no repeats anywhere: nothing repeated, every pair distinct; no NLL -> no perplexity
    plain = repetition(Streams(np.array([[3, 4, 5]]), np.array([[9, 3, 4]])))
    assert plain == {"repeated_pairs": 0.0, "distinct_2": 1.0}
    # a previous token above the largest token must not alias another pair: (5, 0) vs (0, 5)
    alias = repetition(Streams(np.array([[0, 5]]), np.array([[5, 0]])))
    assert alias["repeated_pairs"] == 0.0 and alias["distinct_2"] == 1.0


def test_detection_curves_threshold_and_tpr(null_streams) -> None:
    pool = dirichlet_pool(np.random.default_rng(0), V_NULL, 1.0, 2.0, 16)
    scheme = make_scheme("simplex", V_NULL, 11, CFG)
    wm = synthetic_streams(scheme, pool, scheme.couple(pool), 50, 100, np.random.default_rng(3))
    det = detection_curves(scheme, wm, null_streams, 0.01, [25, 100], np.random.default_rng(4), 10)
    assert det.fpr_heldout.max() < 0.03 and det.tpr[99] > 0.9 and det.tokens_to(0.9) <= 100
    z = np.arange(1000.0)[:, None]
    assert empirical_threshold(z, 0.01)[0] == 989.0  # exactly 10 of 1000 above


def test_the_test_is_randomised_at_a_tied_threshold_so_discrete_scores_run_at_exactly_alpha() -> None:
    from central.watermark.experiment import detection_rate, tie_probability

    # 1000 null scores: 6 at 3, 20 at 2, the rest 0; at alpha = 1% the threshold is 2 and 4 of its
    # 20 ties must count: gamma = (10 - 6) / 20
    null = np.concatenate([np.full(6, 3.0), np.full(20, 2.0), np.zeros(974)])[:, None]
    thr = empirical_threshold(null, 0.01)
    gamma = tie_probability(null, thr, 0.01)
    assert thr[0] == 2.0 and gamma[0] == pytest.approx(0.2)
    assert detection_rate(null, thr, gamma)[0] == pytest.approx(0.01)  # strict '>' gave 0.006
    wm = np.array([3.0, 2.0, 2.0, 0.0])[:, None]
    assert detection_rate(wm, thr, gamma)[0] == pytest.approx((1 + 2 * 0.2) / 4)
    continuous = np.arange(1000.0)[:, None]  # no ties: the plain '>' test
    assert tie_probability(continuous, empirical_threshold(continuous, 0.01), 0.01)[0] == 0.0


def test_entropy_bins_are_respected() -> None:
    pool = dirichlet_pool(np.random.default_rng(0), 128, 0.2, 0.6, 50)
    H = entropy(pool)
    assert pool.shape == (50, 128) and H.min() >= 0.2 and H.max() < 0.6
    with pytest.raises(ValueError):
        dirichlet_pool(np.random.default_rng(0), 4, 1.5, 1.6, 5, max_draws=8192)


@pytest.mark.parametrize("bad", [
    {"schemes": ["simplex", "nope"]}, {"schemes": []}, {"tokens": [0, 10]}, {"fpr": 0.0}, {"fpr": 0.7},
    {"top_p": 1.5}, {"sinkhorn_reg": 0.0}, {"tilt": 1.0}, {"gamma": 1.0}, {"vocab": 1},
    {"low_entropy": [1.0, 0.5]}, {"high_entropy": [0.1, 9.0]}, {"low_entropy": [0.1]}, {"lms": ["gpt5"]},
    {"null_sequences": 100}, {"regimes": [], "lms": []}, {"sinkhorn_dtype": "float16"}, {"key": -1},
    {"regimes": ["low", "medium"]}, {"lms": ["drafter", "drafter"]}, {"lm_null_sequences": 50},
])
def test_bad_params_give_a_one_line_config_error(bad: dict) -> None:
    with pytest.raises(ConfigError) as err:
        check(WatermarkParams(**bad))
    assert "\n" not in str(err.value)


def test_cli_rejects_bad_params_in_one_line(capsys) -> None:
    assert main(["run", "watermark", "params.fpr=2", "--no-tracking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fpr" in err[0]


def test_small_run_logs_headline_tables_and_plots(tmp_path) -> None:
    overrides = ["params.tokens=[10,20]", "params.vocab=32", "params.pool=16", "params.sequences=30",
                 "params.null_sequences=200", "params.distortion_draws=64", "params.mc_draws=20",
                 "params.regimes=[low]", "params.lms=[test]", "params.lm_sequences=4",
                 "params.lm_null_sequences=200", "params.prompt_tokens=8", "params.schemes=[simplex,redgreen]",
                 "params.heavy_side=64"]
    cfg = C.load_central_config("watermark", overrides)
    cfg.tracking.enabled = False
    summary = run_central(cfg)
    m = summary.metrics
    for key in ("tpr_at_1pct/simplex/low/T20", "tpr_at_1pct/redgreen/test/T10", "kl/simplex", "kl/redgreen",
                "ppl/simplex/test", "ppl/none/test", "tokens_to_tpr90/low", "tpr_at_1pct/low/T20"):
        assert key in m, key
    assert m["tpr_at_1pct/low/T20"] == m["tpr_at_1pct/simplex/low/T20"]
    assert m["kl/simplex"] < 1e-4 < m["kl/redgreen"]
    assert {"summary", "detection", "distortion", "lm"} <= set(summary.tables)
    # schemes x regimes (low, test, test-dedup: the LM text also scored once per (prev, token) pair) x T
    assert len(summary.tables["detection"]) == 2 * 3 * 2
    assert "tpr_at_1pct/simplex/test-dedup/T20" in m
    assert m["fpr_heldout/low/T20"] == m["fpr_heldout/simplex/low/T20"] and 0 <= m["fpr_nominal/low/T20"] <= 1
    # repetition of the LM text, watermarked and not, next to perplexity
    lm_rows = {r["scheme"]: r for r in summary.tables["lm"]}
    assert set(lm_rows) == {"none", "simplex", "redgreen"}
    for name, row in lm_rows.items():
        for key in ("repeated_pairs", "distinct_2", "ppl_first_pairs"):
            assert m[f"{key}/{name}/test"] == row[key], (name, key)
        assert 0 <= row["repeated_pairs"] < 1 and 0 < row["distinct_2"] <= 1 and row["ppl_first_pairs"] > 1
        base = lm_rows["none"]["repeated_pairs"]  # the ratio to unwatermarked text (inf if that repeats nothing)
        want = row["repeated_pairs"] / base if base > 0 else (1.0 if row["repeated_pairs"] == 0 else math.inf)
        assert row["repeated_pairs_ratio"] == pytest.approx(want)
    assert lm_rows["none"]["repeated_pairs_ratio"] == 1.0
    summary_lm = [r for r in summary.tables["summary"] if r["regime"] == "test"]
    assert summary_lm and all("repeated_pairs" in r and "distinct_2" in r and "ppl" in r for r in summary_lm)
