"""OmniDraft: lossless cross-vocabulary speculative decoding, n-gram translation, online parts, config."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats as st

from central.omnidraft.checks import chi_square
from central.omnidraft.decode import CachedLM, target_only
from central.omnidraft.method import OmniDraftParams, build_decoder, check, load_models, stream_prompts
from central.omnidraft.online import TrainItem
from central.omnidraft.verify import verify_sample
from central.omnidraft.vocab import VocabBridge, proposal_q, residual_q, translate
from fedsim import config as C
from fedsim.cli import main
from fedsim.errors import ConfigError

SMALL = OmniDraftParams(target_preset="test", target_vocab=1024, drafter_preset="test", dtype="float64",
                        prompts=2, prompt_tokens=24, new_tokens=20, k=4, dist_samples=600)


class _Ctx:
    """The two seeding helpers build_decoder needs."""

    def generator(self, *stream: object) -> torch.Generator:
        return torch.Generator().manual_seed(sum(map(ord, str(stream))))

    def seed(self, *stream: object) -> int:
        return sum(map(ord, str(stream)))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    m = load_models(SMALL)
    return m, VocabBridge(m.drafter_tok, m.target_tok), stream_prompts(m.target_tok, 2, 24, 20)


def _merging_target(bridge: VocabBridge) -> int:
    """A target token the draft tokenizer spells with 3 tokens, none of them special."""
    return next(t for t in range(300, bridge.target_vocab) if len(bridge.spelling(t)) == 3)


class _ScriptedTarget(torch.nn.Module):
    """The test target with its logits pushed towards a file's own next tokens (at 2 positions in 3).

    The bare test target's greedy output is one whitespace token over and over; this keeps its KV
    cache and numerics but makes greedy decoding produce real code (tokens the drafter spells with
    several tokens) and still disagree with the script now and then.
    """

    def __init__(self, inner: torch.nn.Module, script: list[int]) -> None:
        super().__init__()
        self.inner, self.script, self.config = inner, script, inner.config

    def forward(self, input_ids: torch.Tensor, cache=None, **kw):
        past = cache.get_seq_length() if cache is not None else 0
        out = self.inner(input_ids=input_ids, cache=cache, **kw)
        for j in range(input_ids.shape[1]):
            pos = past + j + 1
            if pos < len(self.script) and pos % 3:
                out.logits[0, j, self.script[pos]] += 8.0
        return out


def _scripted(models, i: int):
    """(models with a scripted target, bridge, prompt) for held-out prompt i."""
    from central.lm.corpus import load_corpus, read_source
    from central.omnidraft.vocab import backend

    m, bridge, prompts = models
    name, prompt = prompts[i]
    path = next(f for f in load_corpus().heldout_files if f.name == name)
    script = backend(m.target_tok).encode(read_source(path)[:20_000]).ids
    assert script[: len(prompt)] == prompt
    return replace(m, target=_ScriptedTarget(m.target, script)), bridge, prompt


# -- translation ---------------------------------------------------------------------------------


def test_vocabularies_differ_and_direct_map_is_byte_equality(models) -> None:
    _, bridge, _ = models
    assert bridge.draft_vocab == 512 and bridge.target_vocab == 1024
    for d in range(bridge.draft_vocab):
        t = int(bridge.d2t[d])
        if bridge.draft_bytes[d] is not None:
            assert t >= 0 and bridge.target_bytes[t] == bridge.draft_bytes[d]
    t = _merging_target(bridge)
    assert b"".join(bridge.draft_bytes[d] for d in bridge.spelling(t)) == bridge.target_bytes[t]


def test_ngram_cache_merges_a_draft_run_into_its_target_token_with_product_q(models) -> None:
    m, bridge, _ = models
    dec = build_decoder("b", m, bridge, SMALL, _Ctx())
    t = _merging_target(bridge)
    run = list(bridge.spelling(t))
    other = int(np.flatnonzero(bridge.d2t.numpy() >= 0)[5])
    drafts = [other] + run + [other]
    direct, stuck = translate(drafts, bridge, dec.cache)  # empty cache: every draft token maps alone
    assert not stuck and [p.target for p in direct] == [int(bridge.d2t[d]) for d in drafts]
    dec._fill_cache([t])
    props, _ = translate(drafts, bridge, dec.cache)
    assert [(p.target, p.start, p.n) for p in props] == [(int(bridge.d2t[other]), 0, 1), (t, 1, 3),
                                                         (int(bridge.d2t[other]), 4, 1)]
    q = torch.softmax(torch.randn(len(drafts), bridge.draft_vocab, generator=torch.Generator().manual_seed(0)), -1)
    expected = float(q[1, run[0]] * q[2, run[1]] * q[3, run[2]])
    assert proposal_q(q, drafts, props[1]) == pytest.approx(expected, rel=1e-12)
    assert proposal_q(q, drafts, props[0]) == pytest.approx(float(q[0, other]))
    res = residual_q(q[1], bridge, (t, int(bridge.d2t[run[0]]), expected))
    assert float(res[t]) == pytest.approx(expected) and float(res.sum()) == pytest.approx(float(q[1].sum()))


# -- the acceptance / residual rule ----------------------------------------------------------------------


def _spec_sample(p: torch.Tensor, q: torch.Tensor, n: int, seed: int, wrong: bool = False) -> list[int]:
    """n first tokens: t ~ q over target tokens + a last "untranslatable" symbol, then verify_sample."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    q_target = q[:-1]
    for _ in range(n):
        t = int(torch.multinomial(q, 1, generator=gen))
        if t == len(q) - 1:  # nothing translatable: a forced rejection at this position
            v = verify_sample(p[None], [], [], [p if wrong else q_target], "reject", gen)
            out.append(v.token)
        else:
            v = verify_sample(torch.stack([p, p]), [t], [float(q[t])], [p if wrong else q_target], "bonus", gen)
            out.append(t if v.accepted else v.token)
    return out


def test_speculative_sampling_rule_preserves_the_target_distribution() -> None:
    p = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=torch.float64)
    q = torch.tensor([0.10, 0.35, 0.05, 0.20, 0.15, 0.05, 0.10], dtype=torch.float64)  # last: untranslatable
    n = 10_000
    draws = _spec_sample(p, q, n, seed=0)
    counts = np.bincount(draws, minlength=6)
    assert st.chisquare(counts, p.numpy() * n).pvalue > 1e-3
    wrong = np.bincount(_spec_sample(p, q, n, seed=0, wrong=True), minlength=6)  # resampling from p is biased
    assert st.chisquare(wrong, p.numpy() * n).pvalue < 1e-6


def test_two_position_blocks_keep_the_joint_distribution() -> None:
    """Proposals t1, t2 ~ q (independent), p independent of context: the first two tokens ~ p ⊗ p."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    n, pairs = 8_000, []
    for _ in range(n):
        t = torch.multinomial(q, 2, replacement=True, generator=gen).tolist()
        v = verify_sample(torch.stack([p, p, p]), t, [float(q[x]) for x in t], [q, q], "bonus", gen)
        emitted = t[: v.accepted] + [v.token]
        if len(emitted) < 2:  # rejected at the first position: the next token comes from a new block
            emitted.append(_one_block(p, q, gen))
        pairs.append(3 * emitted[0] + emitted[1])
    counts = np.bincount(pairs, minlength=9)
    assert st.chisquare(counts, np.outer(p, p).ravel() * n).pvalue > 1e-3


def _one_block(p: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> int:
    """One fresh single-proposal block: propose from q, verify, return the emitted token."""
    t = int(torch.multinomial(q, 1, generator=gen))
    v = verify_sample(torch.stack([p, p]), [t], [float(q[t])], [q], "bonus", gen)
    return t if v.accepted else v.token


def test_first_emitted_token_of_variant_b_with_real_models_matches_the_target(models) -> None:
    """The real tiny models through the real decoder (generate, one token): the first token ~ p."""
    m, bridge, prompts = models
    dec = build_decoder("b", m, bridge, replace(SMALL, mode="sample"), _Ctx())
    prompt = prompts[0][1][:12]
    dec._fill_cache(prompts[0][1])
    p = torch.softmax(m.target(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, -1].detach().double(), -1)
    text, gen = bridge.target_text(prompt).decode(), torch.Generator().manual_seed(3)
    draws = [dec.generate(prompt, text, 2, gen)[0][0] for _ in range(300)]
    assert chi_square(draws, p).pvalue > 1e-3


# -- decoding ------------------------------------------------------------------------------------


def test_kv_cache_crop_and_extend_match_a_fresh_forward(models) -> None:
    m, _, prompts = models
    lm = CachedLM(m.target)
    ids = prompts[0][1]
    lm.set_ids(ids[:10])
    lm.forward()
    lm.set_ids(ids[:10] + [5, 6, 7])  # proposals
    lm.forward()
    lm.set_ids(ids[:11] + [9])  # rejection after one: crop back, then extend
    got = lm.forward()[0][-1]
    want = m.target(input_ids=torch.tensor([ids[:11] + [9]]), use_cache=False).logits[0, -1]
    assert lm.n_cached == 12 and torch.allclose(got, want, atol=1e-9)


@pytest.mark.parametrize("letter", ["a", "b", "c", "d"])
def test_greedy_speculative_decoding_equals_target_greedy(models, letter) -> None:
    accepted, dec = 0, None
    for i in range(2):
        m, bridge, prompt = _scripted(models, i)
        dec = build_decoder(letter, m, bridge, SMALL, _Ctx()) if dec is None else dec
        dec.target.model = m.target  # the stream goes on (cache, LoRA, head) with this prompt's target
        if letter != "a":  # give the cache something to merge
            dec._fill_cache(prompt)
        ref, _, _ = target_only(CachedLM(m.target), prompt, SMALL.new_tokens, greedy=True, temperature=1.0,
                                eos=m.eos, gen=torch.Generator())
        out, stats = dec.generate(prompt, bridge.target_text(prompt).decode("utf-8", "replace"), SMALL.new_tokens,
                                  torch.Generator())
        assert out == ref, f"variant {letter}, prompt {i}"
        assert stats.target_calls <= len(out) and stats.generated == len(out)
        accepted += stats.accepted
    assert len(set(ref)) > 5  # real code, not one token repeated
    assert accepted > 0


def test_sampling_same_seed_same_outputs(models) -> None:
    m, bridge, prompts = models
    params = replace(SMALL, mode="sample")
    runs = []
    for _ in range(2):
        dec = build_decoder("c", m, bridge, params, _Ctx())
        name, prompt = prompts[0]
        dec._fill_cache(prompt)
        out, stats = dec.generate(prompt, bridge.target_text(prompt).decode(), 20, torch.Generator().manual_seed(7))
        runs.append((out, stats.accepted, stats.target_calls, dec.distiller.losses))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("mode", ["greedy"])
def test_merged_proposals_from_an_oracle_drafter_are_accepted_and_greedy_stays_exact(models, mode) -> None:
    """A stub drafter spells the target's own greedy continuation (one wrong token in four).

    (Greedy only: sampling drafts through the exact walk, not ``dec.draft``; its exactness with merged
    proposals is tested in test_omnidraft_exact.py.)"""
    from central.omnidraft.decode import Draft

    m, bridge, prompt = _scripted(models, 1)
    ref, _, _ = target_only(CachedLM(m.target), prompt, SMALL.new_tokens, greedy=True, temperature=1.0, eos=m.eos,
                            gen=torch.Generator())
    dec = build_decoder("b", m, bridge, replace(SMALL, mode=mode, k=8), _Ctx())
    dec._fill_cache(ref)
    state = {"n": 0, "calls": 0}
    block = dec._block

    def counting_block(committed, *args):
        state["n"] = len(committed) - len(prompt)
        return block(committed, *args)

    def oracle(gen):
        state["calls"] += 1
        tokens = [d for t in ref[state["n"] : state["n"] + 4] for d in bridge.spelling(t)][: dec.cfg.k]
        if state["calls"] % 4 == 0:
            tokens[-1] = (tokens[-1] + 1) % bridge.draft_vocab
        q = torch.full((bridge.draft_vocab,), 0.5 / bridge.draft_vocab, dtype=torch.float64)
        return Draft(tokens, [q.index_put((torch.tensor(t),), torch.tensor(0.5, dtype=torch.float64)) for t in tokens])

    dec._block, dec.draft = counting_block, oracle
    out, stats = dec.generate(prompt, bridge.target_text(prompt).decode(), SMALL.new_tokens, torch.Generator())
    assert stats.merged_accepted > 0 and stats.target_calls < len(out) / 2
    if mode == "greedy":
        assert out == ref


def test_lora_starts_as_the_drafter_and_a_step_lowers_the_hybrid_loss(models) -> None:
    m, bridge, prompts = models
    dec = build_decoder("c", m, bridge, SMALL, _Ctx())
    context = bridge.encode_text(bridge.target_text(prompts[0][1]).decode())
    x = torch.tensor([context])
    assert torch.allclose(dec.drafter.model(input_ids=x).logits, m.drafter(input_ids=x).logits, atol=1e-12)
    p = torch.softmax(torch.randn(bridge.target_vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1)
    t = _merging_target(bridge)
    items = [TrainItem(len(context) - 3, (context[-3],), p, int(bridge.d2t[context[-3]])),
             TrainItem(len(context) - 2, tuple(context[-2:]), p, t)]
    first = dec.distiller.update(context, items)
    for _ in range(5):
        last = dec.distiller.update(context, items)
    assert last < first
    assert not torch.allclose(dec.drafter.model(input_ids=x).logits, m.drafter(input_ids=x).logits)


def test_acceptance_head_shortens_drafts_when_it_predicts_rejection(models) -> None:
    m, bridge, prompts = models
    dec = build_decoder("d", m, bridge, replace(SMALL, head_threshold=0.5), _Ctx())
    torch.nn.init.constant_(dec.head.linear.bias, -5.0)  # predicts ~0.007: stop after every draft token
    dec.head.steps = 0
    name, prompt = prompts[0]
    _, stats = dec.generate(prompt, bridge.target_text(prompt).decode(), 10, torch.Generator())
    assert stats.draft_tokens == stats.blocks and stats.head_stops == stats.blocks


# -- the registered method -----------------------------------------------------------------------------


def _yaml(tmp_path) -> str:
    path = tmp_path / "omni.yaml"
    path.write_text("method: omnidraft\ndescription: test\nseed: 0\nparams:\n  target_preset: test\n"
                    "  target_vocab: 1024\n  drafter_preset: test\n  dtype: float64\n  prompts: 2\n"
                    "  prompt_tokens: 16\n  new_tokens: 8\n  k: 3\n  dist_samples: 100\n")
    return str(path)


def test_run_is_seeded_and_logs_tables_and_plots(tmp_path) -> None:
    from fedsim.central_runner import run_central

    def once(seed: int):
        cfg = C.load_central_config(_yaml(tmp_path), seed=seed)
        cfg.tracking.enabled = False
        return run_central(cfg)

    a, b = once(0), once(0)
    deterministic = [k for k in a.metrics if not k.startswith(("speedup", "target_only", "timing/"))]
    assert {k: a.metrics[k] for k in deterministic} == {k: b.metrics[k] for k in deterministic}
    assert a.metrics["greedy_identical"] == 1.0 and "accepted_per_call/a" in a.metrics
    assert {"variants", "stream", "models", "sampling_exactness", "ngram_cache"} <= set(a.tables)
    assert [r.round for r in a.history.records] == [1, 2]


def test_claim_spec_reads_only_metrics_a_run_of_its_mode_logs(tmp_path) -> None:
    from central.omnidraft.method import check as check_params
    from fedsim.central_runner import run_central
    from tests.central.claim_spec import checked_claim_spec, logged_metrics

    spec, grid = checked_claim_spec("omnidraft", check_params)
    assert [s["params.mode"] for s in grid] == ["greedy", "sample"] and spec.has_protocol and len(spec.seeds) >= 3
    for mode in ("greedy", "sample"):
        cfg = C.load_central_config(_yaml(tmp_path), [f"params.mode={mode}"], seed=0)
        cfg.tracking.enabled = False
        logged = logged_metrics(run_central(cfg))
        read = {m for c in [*spec.claim, *spec.controls.positive] if c.at == {"params.mode": mode}
                for m in c.metrics(spec.metric)}
        assert read and not read - logged, f"{mode}: the claim spec reads metrics no run logs: {sorted(read - logged)}"


def test_bad_params_give_one_line_config_errors(tmp_path, capsys) -> None:
    for bad in (dict(variants="abx"), dict(variants=""), dict(mode="beam"), dict(k=0), dict(head_threshold=1.5),
                dict(target="gpt2"), dict(target_preset="test", drafter_preset="test"), dict(kd_target="all"),
                dict(prompt_tokens=500, new_tokens=100)):
        with pytest.raises(ConfigError):
            check(replace(OmniDraftParams(), **bad))
    assert main(["run", _yaml(tmp_path), "params.variants=aq", "--no-tracking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "variants" in err[0]


@pytest.mark.slow
@pytest.mark.parallel
def test_smollm2_target_with_its_own_tokenizer_stays_lossless_under_greedy() -> None:
    params = replace(OmniDraftParams(), target="smollm2", drafter_preset="test")
    m = load_models(params)
    bridge = VocabBridge(m.drafter_tok, m.target_tok)
    assert bridge.target_vocab == 49152 and bridge.intersection() > 400
    name, prompt = stream_prompts(m.target_tok, 1, 24, 12)[0]
    ref, _, _ = target_only(CachedLM(m.target), prompt, 12, greedy=True, temperature=1.0, eos=m.eos, gen=torch.Generator())
    dec = build_decoder("d", m, bridge, params, _Ctx())
    out, stats = dec.generate(prompt, bridge.target_text(prompt).decode("utf-8", "replace"), 12, torch.Generator())
    assert out == ref and stats.target_calls <= len(out)


# -- where the time goes (issue #26: OmniDraft is slower than plain decoding; the profile says why) --------


@pytest.mark.parametrize("letter", ["b", "c"])
def test_decoding_time_splits_into_forwards_rebuilds_and_python(models, letter) -> None:
    m, bridge, prompts = models
    dec = build_decoder(letter, m, bridge, SMALL, _Ctx())
    _, prompt = prompts[0]
    _, stats = dec.generate(prompt, bridge.target_text(prompt).decode("utf-8", "replace"), 20, torch.Generator())
    assert 0 < stats.target_forward_seconds and 0 < stats.drafter_forward_seconds
    assert stats.target_forward_seconds + stats.drafter_forward_seconds <= stats.decode_seconds
    assert stats.drafter_rebuild_seconds <= stats.drafter_forward_seconds
    # (c) drops the drafter's cache after every distillation step, so it re-encodes its context; (b) never does
    assert (stats.drafter_rebuild_seconds > 0) == (letter == "c")


def test_profile_shares_add_up_and_the_breakeven_cost_gives_a_speedup_of_one() -> None:
    from central.omnidraft.decode import Stats
    from central.omnidraft.method import Baseline, profile

    t = Stats(target_calls=10, drafter_calls=40, decode_seconds=2.0, target_forward_seconds=0.8,
              drafter_forward_seconds=0.9, drafter_rebuild_seconds=0.3)
    base = Baseline(seconds=1.5, forward_seconds=1.2, calls=30)  # 40 ms per target-only forward
    got = profile(t, base)
    shares = got["share_target"] + got["share_drafter"] + got["share_drafter_rebuild"] + got["share_python"]
    assert shares == pytest.approx(1.0) and got["share_python"] == pytest.approx(0.15)
    assert got["drafter_cost_ratio"] == pytest.approx(22.5 / 40) and got["drafter_calls_per_target_call"] == 4
    # with each drafter forward at the break-even cost, decoding takes exactly as long as target-only
    at_breakeven = (t.decode_seconds - t.drafter_forward_seconds) + t.drafter_calls * got["breakeven_cost_ratio"] * 0.04
    assert at_breakeven == pytest.approx(base.seconds)
    assert got["speedup_free_drafter"] == pytest.approx(1.5 / 1.1)
    # a decoder that loses even with free drafting has no positive break-even cost
    slow = profile(Stats(target_calls=10, drafter_calls=40, decode_seconds=2.0, target_forward_seconds=1.6,
                         drafter_forward_seconds=0.1), base)
    assert slow["breakeven_cost_ratio"] < 0 and slow["speedup_free_drafter"] < 1
