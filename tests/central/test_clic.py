"""CLIC: rendering and captions, slot-level hard negatives, the three losses, the frozen image tower,
the schedule, the image-tower probe, determinism of the run, the parameter checks and the claim spec."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from fedsim.central_runner import run_central
from central.clic.batches import Sampler, stack_pair
from central.clic.losses import clic_loss, clip_loss, negclip_loss
from central.clic.model import ModelSpec, build
from central.clic.negatives import EVAL_TYPES, eval_negative, swap_between, swap_within
from central.clic.probe import oracle, probe, scene_of
from central.clic.run import ClicParams, check
from central.clic.tokens import encode, word_tokenizer
from central.clic.train import FinetuneSpec, clip_loss_pattern, finetune, lr_at
from central.clic.world import (COLOURS, SLOT_TYPE, World, phrasings, render, sentence, shape_mask, split_scenes)
from fedsim import config as C
from fedsim.cli import main
from fedsim.errors import ConfigError

WORLD = World(n_colours=4, n_shapes=4, size=32, noise=0.0)


def _tok():
    return word_tokenizer(WORLD, 24)


def _ids(text: str) -> list[int]:
    return [i for i in encode(_tok(), [text])[0].tolist() if i != 0]


# -- the world ----------------------------------------------------------------------------------------

def test_rendering_is_deterministic_per_seed() -> None:
    scenes = WORLD.scenes()[:12]
    world = World(4, 4, 32, noise=0.05)
    a, _ = render(world, scenes, np.random.default_rng(3))
    b, _ = render(world, scenes, np.random.default_rng(3))
    c, _ = render(world, scenes, np.random.default_rng(4))
    assert a.shape == (12, 3, 32, 32) and a.dtype == np.float32
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.min() >= 0.0 and a.max() <= 1.0


def test_caption_slots_match_the_rendered_objects() -> None:
    scenes = WORLD.scenes()
    images, geo = render(WORLD, scenes, np.random.default_rng(0))
    pix = np.arange(WORLD.size) + 0.5
    yy, xx = np.meshgrid(pix, pix, indexing="ij")
    for i in range(0, len(scenes), 7):
        objs = (scenes[i].first, scenes[i].second)
        for k, obj in enumerate(objs):  # the object's pixels have its colour and its shape's outline
            mask = geo.masks[i, k]
            assert mask.sum() > 20
            mean_rgb = images[i][:, mask].mean(1)
            assert np.abs(mean_rgb - np.array(COLOURS[obj.colour])).max() <= 0.051
            (cx, cy), r = geo.centres[i, k], geo.radii[i, k]
            assert np.array_equal(mask, shape_mask(obj.shape, xx - cx, yy - cy, r))
        for s in phrasings(scenes[i]):  # every phrasing names the object that is where it says
            subject = 0 if (s.slot("c1"), s.slot("s1")) == (objs[0].colour, objs[0].shape) else 1
            assert (s.slot("c1"), s.slot("s1")) == (objs[subject].colour, objs[subject].shape)
            assert (s.slot("c2"), s.slot("s2")) == (objs[1 - subject].colour, objs[1 - subject].shape)
            (sx, sy), (ox, oy) = geo.centres[i, subject], geo.centres[i, 1 - subject]
            expected = {"left of": sx < ox, "right of": sx > ox, "above": sy < oy, "below": sy > oy}
            assert expected[s.slot("rel")], (s.text, sx, sy, ox, oy)


def test_heldout_split_keeps_object_pairs_apart() -> None:
    train, held = split_scenes(WORLD, 0.25, seed=0)
    pair = lambda s: frozenset((s.first, s.second))  # noqa: E731
    assert held and train and not ({pair(s) for s in train} & {pair(s) for s in held})
    assert len(train) + len(held) == len(WORLD.scenes())
    assert split_scenes(WORLD, 0.25, seed=0) == (train, held)


# -- hard negatives ------------------------------------------------------------------------------------

def _token_positions(s, slots: set[str]) -> list[int]:
    """Token indices (after <cls>) of the words of the given slots."""
    out, pos = [], 1
    for slot, words in s.chunks:
        n = len(words.split())
        if slot in slots:
            out += list(range(pos, pos + n))
        pos += n
    return out


def _slot_diff(a, b) -> set[str]:
    assert [s for s, _ in a.chunks] == [s for s, _ in b.chunks]
    return {sa for (sa, wa), (_, wb) in zip(a.chunks, b.chunks) if wa != wb}


def test_clic_negative_differs_from_the_positives_exactly_in_the_swapped_slots() -> None:
    rng = np.random.default_rng(0)
    scenes = WORLD.scenes()
    seen = set()
    for _ in range(300):
        s1 = sentence(scenes[rng.integers(len(scenes))], "a", int(rng.integers(2)))
        s2 = sentence(scenes[rng.integers(len(scenes))], "the", int(rng.integers(2)))
        out = swap_between(s1, s2, rng)
        if out is None:
            continue
        n1, n2, kind = out
        seen.add(kind)
        d1, d2 = _slot_diff(s1, n1), _slot_diff(s2, n2)
        assert d1 and d2 and {SLOT_TYPE[s] for s in d1 | d2} == {kind}
        # the words moved between the sentences: s1's changed slots now hold s2's word and vice versa
        (w1,), (w2,) = {s1.slot(s) for s in d1}, {s2.slot(s) for s in d2}
        assert {n1.slot(s) for s in d1} == {w2} and {n2.slot(s) for s in d2} == {w1} and w1 != w2
        # token level: outside the swapped slots the token sequences are identical
        if kind != "relation":
            t1, u1 = _ids(s1.text), _ids(n1.text)
            assert len(t1) == len(u1)
            changed = [i for i, (x, y) in enumerate(zip(t1, u1)) if x != y]
            assert changed == _token_positions(s1, d1)
        # the concatenated negative holds exactly the words of p1 (a bag-of-words twin)
        p1 = _ids(s1.text + " " + s2.text)
        assert Counter(_ids(n1.text + " " + n2.text)) == Counter(p1)
        assert n1.text + " " + n2.text not in (s1.text + " " + s2.text, s2.text + " " + s1.text)
    assert seen == {"colour", "shape", "relation"}


def test_no_swap_when_the_sentences_share_every_word_type() -> None:
    s = sentence(WORLD.scenes()[0], "a", 0)
    assert swap_between(s, s, np.random.default_rng(0)) is None


def test_clic_batch_negatives_are_bag_of_words_twins_of_p1() -> None:
    train, _ = split_scenes(WORLD, 0.2, 0)
    batch = Sampler(WORLD, train, _tok(), n_extra=2).clic(16, np.random.default_rng(1))
    assert len(batch.positives) == 4 and batch.images.shape == (16, 3, 64, 32)
    for p1, p2, neg in zip(batch.positives[0], batch.positives[1], batch.negative):
        bag = lambda ids: Counter(i for i in ids.tolist() if i != 0)  # noqa: E731
        assert bag(neg) == bag(p1) == bag(p2)
        assert not torch.equal(neg[:len(p1)], p1[:len(neg)])
    for text1, text2 in zip(batch.texts["p1"], batch.texts["p2"]):
        a, b = text1.split(" . ")[0] + " .", text1.split(" . ")[1]
        assert text2 == b + " " + a  # p2 = s2 ⊕ s1


def test_negclip_negative_swaps_two_slots_of_one_type() -> None:
    rng = np.random.default_rng(2)
    for scene in WORLD.scenes()[:40]:
        s = sentence(scene, "the", 1)
        neg, kind = swap_within(s, rng)
        diff = _slot_diff(s, neg)
        assert diff in ({"c1", "c2"}, {"s1", "s2"}) and {SLOT_TYPE[d] for d in diff} == {kind}
        assert Counter(_ids(neg.text)) == Counter(_ids(s.text))


@pytest.mark.parametrize("kind", EVAL_TYPES)
def test_eval_negatives_change_what_their_type_says(kind: str) -> None:
    rng = np.random.default_rng(5)
    for scene in WORLD.scenes()[:30]:
        s = sentence(scene, "a", 0)
        neg = eval_negative(s, kind, WORLD.colours, WORLD.shapes, rng)
        diff = _slot_diff(s, neg)
        expected = {"swap_att": [{"c1", "c2"}], "swap_obj": [{"s1", "s2"}], "replace_rel": [{"rel"}],
                    "replace_att": [{"c1"}, {"c2"}], "replace_obj": [{"s1"}, {"s2"}]}[kind]
        assert diff in expected
        if kind.startswith("replace"):
            new = neg.slot(next(iter(diff)))
            assert new not in {w for _, w in s.chunks}  # a word the caption did not use


# -- losses --------------------------------------------------------------------------------------------

IMG = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
P1 = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
P2 = torch.tensor([[0.8, 0.6], [0.0, 1.0]])
NEG = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
SCALE = torch.tensor(2.0)


def _ce(logits: list[float], target: int) -> float:
    return -logits[target] + math.log(sum(math.exp(v) for v in logits))


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum())


def _clip_by_hand(img: torch.Tensor, txt: torch.Tensor, s: float) -> tuple[float, float]:
    n = len(img)
    i2t = sum(_ce([s * _dot(img[i], txt[j]) for j in range(n)], i) for i in range(n)) / n
    t2i = sum(_ce([s * _dot(txt[i], img[j]) for j in range(n)], i) for i in range(n)) / n
    return i2t, t2i


def test_clip_loss_equals_the_hand_computed_value() -> None:
    i2t, t2i = _clip_by_hand(IMG, P1, 2.0)
    # e.g. row 0 of image->text: logits [2, 1.2], target 0
    assert abs(_ce([2.0, 1.2], 0) - (-2.0 + math.log(math.exp(2.0) + math.exp(1.2)))) < 1e-12
    assert abs(float(clip_loss(IMG, P1, SCALE)) - (i2t + t2i) / 2) < 1e-6


def test_negclip_loss_equals_the_hand_computed_value() -> None:
    texts = torch.cat([P1, NEG])
    i2t = sum(_ce([2.0 * _dot(IMG[i], texts[j]) for j in range(4)], i) for i in range(2)) / 2
    _, t2i = _clip_by_hand(IMG, P1, 2.0)
    assert abs(float(negclip_loss(IMG, P1, NEG, SCALE)) - (i2t + t2i) / 2) < 1e-6


def test_clic_loss_terms_equal_the_hand_computed_values() -> None:
    terms = clic_loss(IMG, [P1, P2], NEG, SCALE, cont=0.5, sneg=0.5, uni=1.0)
    (a1, b1), (a2, b2) = _clip_by_hand(IMG, P1, 2.0), _clip_by_hand(IMG, P2, 2.0)
    contrastive = ((a1 + a2) / 2 + (b1 + b2) / 2) / 2
    hard = sum(_ce([2.0 * _dot(IMG[i], P[i]), 2.0 * _dot(IMG[i], NEG[i])], 0) for P in (P1, P2) for i in range(2)) / 4
    uni = sum(float(((P1[i] - P2[i]) ** 2).sum()) for i in range(2)) / 2
    assert abs(float(terms["contrastive"]) - contrastive) < 1e-6
    assert abs(float(terms["hard_negative"]) - hard) < 1e-6
    assert abs(float(terms["uni_modal"]) - uni) < 1e-6 and uni > 0
    assert abs(float(terms["total"]) - (0.5 * contrastive + 0.5 * hard + uni)) < 1e-6
    assert float(clic_loss(IMG, [P1, P1], NEG, SCALE)["uni_modal"]) == 0.0


# -- training --------------------------------------------------------------------------------------------

def _tiny_model():
    spec = ModelSpec(vocab=_tok().get_vocab_size(), max_len=24, embed=8, width=8, layers=1, heads=2, channels=(4, 4, 8))
    return build(spec, seed=0)


@pytest.mark.parametrize("variant", ["clip", "negclip", "clic", "clic_noconcat"])
def test_finetuning_leaves_the_image_tower_untouched(variant: str) -> None:
    model = _tiny_model()
    before_visual = {k: v.clone() for k, v in model.visual.state_dict().items()}
    before_text = {k: v.clone() for k, v in model.text.state_dict().items()}
    train, _ = split_scenes(WORLD, 0.2, 0)
    sampler = Sampler(WORLD, train, _tok(), n_extra=2)
    finetune(model, sampler, FinetuneSpec(variant, steps=3, batch=6, lr=1e-2, lr_start=1e-2, lr_end=1e-2),
             np.random.default_rng(0))
    assert all(torch.equal(before_visual[k], v) for k, v in model.visual.state_dict().items())
    assert all(p.grad is None and not p.requires_grad for p in model.visual.parameters())
    assert any(not torch.equal(before_text[k], v) for k, v in model.text.state_dict().items())


def test_schedule_and_alternation_follow_the_authors() -> None:
    assert clip_loss_pattern(1) == [True, False]
    assert clip_loss_pattern(2) == [False, True, True]
    assert clip_loss_pattern(0.5) == [True, False, False]
    lrs = [lr_at(t, 10, 1.0, 0.1, 0.01, 0.2) for t in range(10)]
    assert lrs[0] == pytest.approx(0.1) and lrs[1] == pytest.approx(1.0)  # warm-up over 2 steps
    assert lrs[2] == pytest.approx(1.0) and all(a >= b for a, b in zip(lrs[2:], lrs[3:])) and lrs[-1] > 0.01


def test_stack_pair_stacks_the_two_images_in_either_order() -> None:
    a, b = torch.rand(8, 3, 32, 32), torch.rand(8, 3, 32, 32)
    out = stack_pair(a, b, np.random.default_rng(0), squash=False)
    assert out.shape == (8, 3, 64, 32)
    tops = [torch.equal(out[i, :, :32], a[i]) for i in range(8)]
    for i in range(8):
        assert torch.equal(out[i, :, 32:], b[i] if tops[i] else a[i])
    assert 0 < sum(tops) < 8
    assert stack_pair(a, b, np.random.default_rng(0), squash=True).shape == (8, 3, 32, 32)


# -- the run ---------------------------------------------------------------------------------------------

TINY = ["params.steps=4", "params.batch=8", "params.n_colours=4", "params.n_shapes=3", "params.channels=[4,4,8]",
        "params.embed=8", "params.width=8", "params.heads=2", "params.layers=1", "params.vision_steps=4",
        "params.pretrain_steps=4", "params.pretrain_batch=8", "params.eval_renders=1", "params.log_every=2",
        "params.variants=[clic,negclip]", "params.probe_pairs=16", "params.probe_renders=2"]


def test_same_seed_gives_identical_metrics(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDSIM_CACHE", str(tmp_path))
    cfg = C.load_central_config("clic", TINY)
    cfg.tracking.enabled = False
    first, second = run_central(cfg), run_central(cfg)  # the second loads the cached pretrained CLIP
    assert first.metrics == second.metrics
    m = first.metrics
    assert m["eval/itt_acc"] == m["clic/itt_acc"] and "negclip/tot_acc" in m and "pretrained/r1_i2t" in m
    assert 0.0 <= m["eval/tot_acc"] <= 1.0 and m["eval/r5_i2t"] >= m["eval/r1_i2t"]
    assert len(first.tables["variants"]) == 3 and len(first.tables["per_type"]) == 3 * len(EVAL_TYPES)
    assert 0.0 <= m["probe/pair_oracle"] <= 1.0 and 0.0 <= m["probe/itt_oracle"] <= 1.0
    assert m["probe/itt_oracle"] == pytest.approx(np.mean([m[f"probe/itt_oracle/{k}"] for k in EVAL_TYPES]))
    held = split_scenes(World(4, 3, 32, 0.02), 0.2, 0)[1]
    assert m["retrieval/chance_r1"] == pytest.approx(1 / len(held))
    assert "claim/min_gain" not in m and not any(k.endswith("/min_gain") for k in m)
    other = run_central(C.load_central_config("clic", TINY, seed=1))
    assert other.metrics != first.metrics


@pytest.mark.parametrize("bad", [
    {"variants": []}, {"variants": ["clic", "clic"]}, {"variants": ["dac"]}, {"steps": 0}, {"batch": 1},
    {"lr": 0.0}, {"uni": -1.0}, {"warmup_frac": 1.0}, {"additional_positives": 3}, {"n_colours": 2},
    {"n_shapes": 6}, {"image_size": 20}, {"heldout_frac": 0.0}, {"width": 10, "heads": 4}, {"channels": [4, 8]},
    {"hard_negative_freq": 0.0}, {"shuffle_prob": 1.5}, {"pair_layout": "grid"}, {"probe_pairs": -1},
    {"probe_renders": 0},
])
def test_bad_params_give_a_one_line_config_error(bad: dict) -> None:
    with pytest.raises(ConfigError) as err:
        check(ClicParams(**bad))
    assert "\n" not in str(err.value)


def test_cli_rejects_bad_params_in_one_line(capsys) -> None:
    assert main(["run", "clic", "params.steps=0", "--no-tracking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "steps" in err[0]


# -- the image-tower probe -------------------------------------------------------------------------------

def test_scene_of_inverts_every_phrasing() -> None:
    for scene in WORLD.scenes():
        assert all(scene_of(s) == scene for s in phrasings(scene))
    s = sentence(WORLD.scenes()[0], "a", 0)
    swapped = scene_of(eval_negative(s, "swap_att", WORLD.colours, WORLD.shapes, np.random.default_rng(0)))
    assert swapped != WORLD.scenes()[0] and swapped.first.shape == WORLD.scenes()[0].first.shape


class _Tower:
    """Stands in for TinyCLIP in the probe: only ``encode_image`` is used."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(self.fn(images), dim=-1)


def _pooled_pixels(x: torch.Tensor) -> torch.Tensor:
    """4x4-pooled pixels of each 32-row scene, summed over the scenes of a stacked pair (so, like the
    pooled CNN, blind to the pair's random order): sees which colour is where."""
    return sum(torch.nn.functional.avg_pool2d(x[:, :, i:i + 32], 4).flatten(1) for i in range(0, x.shape[2], 32))


PIXELS = _Tower(_pooled_pixels)
MEAN_RGB = _Tower(lambda x: x.mean(dim=(2, 3)))  # a bag of colours: blind to where things are
CONSTANT = _Tower(lambda x: torch.ones(len(x), 5))  # sees nothing


def test_probe_separates_with_a_seeing_tower_and_not_with_a_blind_one() -> None:
    train, held = split_scenes(WORLD, 0.25, 0)
    seeing = probe(PIXELS, WORLD, train, held, 48, 4, np.random.default_rng(0))
    for kind in ("replace_att", "swap_att", "replace_rel"):  # colour and position are in the pixels
        assert seeing[f"itt_oracle/{kind}"] > 0.9 and seeing[f"itt_gap/{kind}"] > 0.1
    assert seeing["pair_oracle/colour"] > 0.8 and seeing["pair_oracle"] > 0.7 and seeing["pair_gap"] > 0
    bag = probe(MEAN_RGB, WORLD, train, held, 48, 4, np.random.default_rng(0))
    assert bag["itt_oracle/replace_rel"] < 0.8 and bag["itt_gap/replace_rel"] < 0.01  # where is invisible
    blind = probe(CONSTANT, WORLD, train, held, 48, 4, np.random.default_rng(0))
    assert blind["pair_oracle"] == 0.0 and blind["itt_oracle"] == 0.0  # ties are not separations
    assert abs(blind["pair_gap"]) < 1e-6 and abs(blind["itt_gap"]) < 1e-6
    assert probe(PIXELS, WORLD, train, held, 48, 4, np.random.default_rng(0)) == seeing  # seeded


def test_oracle_counts_an_item_whose_negative_is_itself_as_not_separated() -> None:
    scenes = [(s,) for s in WORLD.scenes()[:6]]
    hit, gap = oracle(PIXELS, WORLD, scenes, scenes, 64, np.random.default_rng(1))
    assert hit.shape == gap.shape == (6,) and np.all(np.abs(gap) < 0.05)  # only centroid noise
    other = [(s,) for s in WORLD.scenes()[6:12]]
    hit, gap = oracle(PIXELS, WORLD, scenes, other, 4, np.random.default_rng(1))
    assert hit.all() and np.all(gap > 0)


# -- the claim spec --------------------------------------------------------------------------------------

def test_claim_spec_is_valid_and_every_child_is_read_by_a_verdict() -> None:
    from tests.central.claim_spec import checked_claim_spec

    spec, grid = checked_claim_spec("clic", check)
    assert {g["params.variants"][0] for g in grid} == {"clip", "negclip", "clic"}
    # the paper's claim: CLIC beats plain CLIP and NegCLIP on ITT and on TOT, and keeps retrieval
    pairs = {(c.better["params.variants"][0], c.worse["params.variants"][0], c.metric or spec.metric)
             for c in spec.claim if c.worse}
    assert pairs == {("clic", w, m) for w in ("clip", "negclip") for m in ("eval/itt_acc", "eval/tot_acc")}
    assert all(c.margin > 0 for c in spec.claim if c.worse)
    (keep,) = [c for c in spec.claim if not c.worse]
    assert (keep.better_metric, keep.worse_metric, keep.at) == ("eval/r1_mean", "pretrained/r1_mean",
                                                               {"params.variants": ["clic"]})
    assert -0.05 < keep.margin < 0  # a non-inferiority with a small stated margin
    assert "min_gain" not in spec.metric and not any("min_gain" in m for m in spec.extra_metrics)
    assert "probe/pair_oracle" in {m for c in spec.controls.positive for m in c.metrics(spec.metric)}
    assert spec.controls.floor.value == pytest.approx(1 / 3, abs=1e-3) and spec.controls.ceiling.value < 1
    assert len(spec.seeds) >= 3 and spec.has_protocol
