"""LRQK: exactness at k = all, the ALS algebra, the hit/miss buffer, Quest bounds, GQA mapping, params."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import eager_attention_forward

from central.lrqk.attend import Shape, SparseRunner, replay, run_prefill
from central.lrqk.factor import Factors, als_prefill, decode_update, penalised_objective
from central.lrqk.run import LRQKParams, check
from central.lrqk.select import (HitMissBuffer, LRQKSelector, OracleSelector, QuestSelector, WindowSelector,
                                 page_bounds)
from fedsim.errors import ConfigError


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def test_lm():
    from central.lm import tiny

    spec = tiny.preset("test")
    model, _ = tiny.load_or_train(spec)
    ids = tiny.corpus_ids(tiny.tokenizer_for(spec), "heldout", 20_000)[:200]
    return model, ids


@pytest.fixture(scope="module")
def gqa_lm():
    """A random Llama with grouped-query attention (4 query heads share 2 KV heads)."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), torch.randint(0, 64, (120,), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def eager_decode_logits(model, ids: torch.Tensor, P: int, steps: int) -> torch.Tensor:
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[None, :P], cache=cache, use_cache=True)
    return torch.stack([model(input_ids=ids[None, P + s : P + s + 1], cache=cache, use_cache=True).logits[0, -1]
                        for s in range(steps)])


# -- exactness ------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [2, 8])
def test_lrqk_with_k_all_tokens_equals_full_attention(test_lm, rank) -> None:
    model, ids = test_lm
    P, S = 96, 10
    ref = eager_decode_logits(model, ids, P, S)
    pre = run_prefill(model, ids, P)
    full = replay(model, ids, pre, S, None, keep_logits=True)
    lrqk = replay(model, ids, pre, S, LRQKSelector(10_000, 4, rank, generator=torch.Generator().manual_seed(0)),
                  keep_logits=True)
    torch.testing.assert_close(full.logits, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lrqk.logits, ref, rtol=1e-4, atol=1e-4)
    assert abs(float(lrqk.losses.mean() - full.losses.mean())) < 1e-5
    recall = torch.stack([s.recall for s in lrqk.steps])
    assert torch.allclose(recall, torch.ones_like(recall), atol=1e-5)
    # a real budget does change the output (the comparison above can fail)
    small = replay(model, ids, pre, S, LRQKSelector(8, 4, rank, generator=torch.Generator().manual_seed(0)),
                   keep_logits=True)
    assert (small.logits - ref).abs().max() > 1e-3
    assert model.config._attn_implementation == "eager"
    assert not hasattr(model.model.layers[0].self_attn, "_lrqk_runner")


def test_gqa_k_all_matches_transformers_eager(gqa_lm) -> None:
    model, ids = gqa_lm
    P, S = 60, 8
    ref = eager_decode_logits(model, ids, P, S)
    pre = run_prefill(model, ids, P)
    for sel in (LRQKSelector(10_000, 4, 4, generator=torch.Generator().manual_seed(0)), OracleSelector(10_000, 4),
                QuestSelector(10_000, 4, 8)):
        out = replay(model, ids, pre, S, sel, keep_logits=True)
        torch.testing.assert_close(out.logits, ref, rtol=1e-4, atol=1e-4)


def test_gqa_sparse_output_matches_eager_with_a_per_query_head_mask(gqa_lm) -> None:
    """Sparse attention over the selection == eager attention masked to the selection, head by head."""
    model, _ = gqa_lm
    g = torch.Generator().manual_seed(3)
    H, Hkv, T, d = 4, 2, 50, 8
    shape = Shape(1, H, Hkv, d)
    q, K, V = torch.randn(H, 1, d, generator=g), torch.randn(Hkv, T, d, generator=g), torch.randn(Hkv, T, d, generator=g)
    sel = OracleSelector(topk=6, window=3)
    runner = SparseRunner(shape, sel, T)
    runner._start_layer(0, torch.randn(H, T - 1, d, generator=g), K[:, : T - 1], V[:, : T - 1])
    out = runner.decode(0, q, K, V, scaling=d**-0.5)
    held = runner.buffers[0].held()
    assert held.shape == (H, 6) and not torch.equal(held[0], held[1])  # query heads of one group pick differently
    mask = torch.full((1, H, 1, T), float("-inf"))
    for h in range(H):
        mask[0, h, 0, held[h]] = 0.0
        mask[0, h, 0, T - 3 :] = 0.0
    module = SimpleNamespace(num_key_value_groups=H // Hkv, training=False)
    ref, _ = eager_attention_forward(module, q[None], K[None], V[None], mask, scaling=d**-0.5)
    torch.testing.assert_close(out.transpose(0, 1), ref[0], rtol=1e-5, atol=1e-6)
    # the selection really is the exact top-k of query head h against KV head h // 2
    for h in range(H):
        scores = q[h, 0] @ K[h // 2, : T - 3].T
        assert set(held[h].tolist()) == set(scores.topk(6).indices.tolist())


def test_layer0_recall_is_highest_for_the_exact_top_k(test_lm) -> None:
    """Teacher forcing: layer 0 sees the same q/K in every run, so the exact top-k must dominate."""
    model, ids = test_lm
    P, S, k, w = 96, 8, 16, 4
    pre = run_prefill(model, ids, P)
    runs = {sel.name: replay(model, ids, pre, S, sel) for sel in
            (OracleSelector(k, w), LRQKSelector(k, w, 4, generator=torch.Generator().manual_seed(0)),
             QuestSelector(k, w, 4), WindowSelector(k, w))}
    layer0 = {name: torch.stack([s.recall[0] for s in r.steps]) for name, r in runs.items()}
    for name in ("lrqk", "quest", "window"):
        assert (layer0["oracle"] >= layer0[name] - 1e-6).all(), name
    assert (layer0["oracle"] <= 1 + 1e-6).all() and (layer0["window"] > 0).all()


# -- the ALS algebra ------------------------------------------------------------------------------

def _rank_r(H: int, l: int, d: int, r: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    Q = torch.randn(H, l, r, generator=g, dtype=torch.float64) @ torch.randn(H, r, d, generator=g, dtype=torch.float64)
    K = torch.randn(H, l, r, generator=g, dtype=torch.float64) @ torch.randn(H, r, d, generator=g, dtype=torch.float64)
    return Q, K


@pytest.mark.parametrize("lam", [1.0, 0.3, 4.0])
def test_als_decreases_the_penalised_objective_monotonically(lam) -> None:
    g = torch.Generator().manual_seed(0)
    Q, K = torch.randn(3, 40, 12, generator=g, dtype=torch.float64), torch.randn(3, 40, 12, generator=g, dtype=torch.float64)
    trace: list[torch.Tensor] = []
    als_prefill(Q, K, 4, lam, lam, iters=15, tol=0.0, generator=torch.Generator().manual_seed(1), trace=trace)
    values = torch.stack(trace)                          # (updates, heads)
    assert len(trace) == 31
    steps = values[1:] - values[:-1]
    assert (steps <= 1e-10 * values[:-1]).all()
    assert (values[-1] < 0.5 * values[0]).all()        # and it actually makes progress


def test_als_reconstructs_a_rank_r_QKt_exactly() -> None:
    Q, K = _rank_r(2, 40, 16, 4, seed=0)
    f = als_prefill(Q, K, 4, iters=300, tol=0.0, generator=torch.Generator().manual_seed(1))
    QKt = Q @ K.transpose(-1, -2)
    rel = (QKt - f.A_Q @ f.A_K.transpose(-1, -2)).norm() / QKt.norm()
    assert rel < 1e-9
    torch.testing.assert_close(f.A_Q @ f.B_Q, Q)
    torch.testing.assert_close(f.A_K @ f.B_K, K)
    assert penalised_objective(Q, K, f).max() < 1e-12 * QKt.square().sum()
    # one rank short, the same ALS cannot be exact
    g = als_prefill(Q, K, 3, iters=20, tol=0.0, generator=torch.Generator().manual_seed(1))
    assert (QKt - g.A_Q @ g.A_K.transpose(-1, -2)).norm() / QKt.norm() > 1e-2


def test_decode_update_refits_B_to_the_new_token() -> None:
    """The code's step ‖dB‖²/‖ĥdB‖² is the exact line search: after it, q̂B_Q = q and k̂B_K = k."""
    Q, K = _rank_r(2, 30, 8, 8, seed=2)
    f: Factors = als_prefill(Q, K, 4, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 1, 8, generator=g, dtype=torch.float64), torch.randn(2, 1, 8, generator=g, dtype=torch.float64)
    B_Q, B_K, q_hat, k_hat = decode_update(f.B_Q, f.B_K, f.A_K[:, :10], K[:, :10], q, k)
    assert q_hat.shape == k_hat.shape == (2, 1, 4)
    torch.testing.assert_close(q_hat @ B_Q, q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_hat @ B_K, k, rtol=1e-5, atol=1e-5)


# -- hit/miss buffer, Quest bounds ----------------------------------------------------------------

def test_hit_miss_buffer_copies_exactly_the_missing_rows() -> None:
    K = torch.arange(12, dtype=torch.float32)[None, :, None].expand(1, 12, 3).clone()  # row i = (i, i, i)
    V = -K
    buf = HitMissBuffer(n_heads=2, capacity=4, head_dim=3)          # 2 query heads share KV head 0
    sequence = [
        ([[0, 1, 2, 3], [4, 5, 6, 7]], [4, 4]),
        ([[0, 2, 4, 5], [4, 5, 6, 7]], [2, 0]),
        ([[0, 2, 4, 5], [5, 6, 8, 9]], [0, 2]),
        ([[6, 7, 8, 9], [0, 1, 2, 3]], [4, 4]),
        ([[6, 7, -1, -1], [1, 2, 10, -1]], [0, 1]),                # padded selections
        ([[6, 7, 8, 11], [1, 2, 10, 11]], [2, 1]),
    ]
    for sel, expected in sequence:
        before = buf.slots.clone()
        copies = buf.update(torch.tensor(sel), K, V, groups=2)
        assert copies.tolist() == expected
        for h in range(2):
            wanted = sorted(x for x in sel[h] if x >= 0)
            held = [x for x in buf.held()[h].tolist() if x >= 0]
            assert held == wanted
            kept = (before[h] >= 0) & torch.isin(before[h], torch.tensor(wanted))
            assert torch.equal(buf.slots[h][kept], before[h][kept])  # hits never move
            valid = buf.slots[h] >= 0
            assert torch.equal(buf.K[h][valid][:, 0], buf.slots[h][valid].float())
            assert torch.equal(buf.V[h][valid][:, 0], -buf.slots[h][valid].float())


def test_quest_page_bounds_are_upper_bounds_of_each_page_max() -> None:
    g = torch.Generator().manual_seed(0)
    H, Hkv, n, d, P = 4, 2, 23, 8, 4                                  # the last page is partial
    q, K = torch.randn(H, 1, d, generator=g), torch.randn(Hkv, n, d, generator=g)
    bounds, page = page_bounds(q, K, 2, P)
    assert bounds.shape == (H, 6)
    for h in range(H):
        scores = (K[h // 2] @ q[h, 0])
        for p in range(6):
            top = scores[page == p].max()
            assert bounds[h, p] >= top - 1e-5
    exact, _ = page_bounds(q, K, 2, 1)                                # one-token pages: the bound is the score
    torch.testing.assert_close(exact, (q @ K.repeat_interleave(2, 0).transpose(-1, -2))[:, 0])


def test_quest_selects_whole_pages_within_budget() -> None:
    g = torch.Generator().manual_seed(1)
    q, K = torch.randn(2, 1, 4, generator=g), torch.randn(1, 40, 4, generator=g)
    sel = QuestSelector(topk=8, window=5, page_size=4).choose(0, q, K, groups=2)
    assert sel.shape == (2, 8)
    for h in range(2):
        chosen = sel[h][sel[h] >= 0]
        assert chosen.max() < 35 and len(set((chosen // 4).tolist())) == 2


# -- params ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    ({"model": "gpt5"}, "params.model"),
    ({"methods": ["lrqk", "h2o"]}, "params.methods"),
    ({"methods": []}, "params.methods"),
    ({"ranks": [0, 8]}, "params.ranks"),
    ({"ranks": [128]}, "head dimension"),
    ({"topks": []}, "params.topks"),
    ({"topks": [8, 64]}, "page_size"),
    ({"topks": [24, 64], "headline_topk": 64}, "multiple"),
    ({"window": 0}, "window"),
    ({"prefill_tokens": 100}, "prefill_tokens"),
    ({"lambda_q": -1.0}, "lambda"),
    ({"decode_iters": 0}, "decode_iters"),
    ({"init": "svd"}, "params.init"),
    ({"headline_topk": 48}, "headline"),
    ({"headline_rank": 4}, "headline"),
])
def test_bad_params_raise_config_error(changes, message) -> None:
    with pytest.raises(ConfigError, match=message):
        check(LRQKParams(**changes))


def test_defaults_pass_the_check_and_a_bad_file_is_a_config_error(tmp_path) -> None:
    check(LRQKParams())
    from fedsim.central_runner import run_central
    from fedsim import config as C

    path = tmp_path / "x.yaml"
    path.write_text("method: lrqk\ndescription: x\nseed: 0\nparams:\n  model: test\n  file: no_such_file.py\n"
                    "  prefill_tokens: 100\n  decode_steps: 2\n  ranks: [4]\n  topks: [16]\n  headline_rank: 4\n"
                    "  headline_topk: 16\n  window: 4\n  page_size: 4\n")
    cfg = C.load_central_config(str(path))
    cfg.tracking.enabled = False
    with pytest.raises(ConfigError, match="params.file"):
        run_central(cfg)


# -- end to end -----------------------------------------------------------------------------------

def test_run_end_to_end_on_the_test_lm_is_seeded_and_consistent(tmp_path) -> None:
    from fedsim.central_runner import run_central
    from fedsim import config as C

    path = tmp_path / "e2e.yaml"
    path.write_text("method: lrqk\ndescription: e2e\nseed: 0\nparams:\n  model: test\n  prefill_tokens: 100\n"
                    "  decode_steps: 6\n  ranks: [4]\n  topks: [16]\n  headline_rank: 4\n  headline_topk: 16\n"
                    "  window: 4\n  page_size: 4\n")
    cfg = C.load_central_config(str(path))
    cfg.tracking.enabled = False
    a, b = run_central(cfg), run_central(cfg)
    assert a.metrics == b.metrics
    rows = {r["setting"]: r for r in a.tables["sweep"]}
    assert set(rows) == {"full", "lrqk(r=4,k=16)", "quest(k=16)", "window(k=16)", "oracle(k=16)"}
    for name, row in rows.items():
        assert 0.0 < row["recall"] <= 1.0 + 1e-6 and row["copies_per_step"] <= row["copies_per_step_no_cache"]
        assert row["budget"] == (106 if name == "full" else 20)
    assert rows["window(k=16)"]["copies_per_step"] == 0 and rows["window(k=16)"]["mem_frac"] < 1
    assert a.metrics["headline/dloss"] == a.metrics["dloss/lrqk"] == rows["lrqk(r=4,k=16)"]["dloss"]
    assert len(a.tables["per_layer_headline"]) == 4 * 2  # 4 methods x 2 layers
    from tests.central.claim_spec import checked_claim_spec, logged_metrics, read_metrics

    spec, grid = checked_claim_spec("lrqk", check)
    assert [s["params.model"] for s in grid] == ["smollm2", "tiny"] and spec.has_protocol and len(spec.seeds) >= 3
    missing = read_metrics(spec) - logged_metrics(a)
    assert not missing, f"the claim spec reads metrics no run logs: {sorted(missing)}"


@pytest.mark.slow
@pytest.mark.parallel
def test_smollm2_gqa_with_k_all_matches_transformers_eager() -> None:
    from central.lrqk.run import load_model

    model, encode, _ = load_model("smollm2")
    ids = torch.tensor(encode("import os\n\ndef walk(top):\n    for name in os.listdir(top):\n        yield name\n" * 8))
    P, S = 60, 3
    assert model.config.num_attention_heads == 3 * model.config.num_key_value_heads
    ref = eager_decode_logits(model, ids, P, S)
    pre = run_prefill(model, ids, P)
    out = replay(model, ids, pre, S, LRQKSelector(10_000, 4, 16, generator=torch.Generator().manual_seed(0)),
                 keep_logits=True)
    torch.testing.assert_close(out.logits, ref, rtol=1e-3, atol=1e-3)
