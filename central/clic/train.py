"""Pretraining the tiny CLIP (cached on disk) and fine-tuning its text tower with one variant's loss.

Pretraining, in two stages from scratch (:func:`pretrain`; cached under ``$FEDSIM_CACHE/clic`` keyed by
:class:`PretrainSpec`):

1. vision: the image tower learns linear read-outs of the scene -- which colours and shapes it holds and
   its arrangement (no binding), plus, with weight ``binding``, its five slots (which colour and shape is
   left/top, which right/bottom) -- so the image embedding carries the binding that a large CLIP's
   image tower has;
2. text (LiT-style): the text tower and the logit scale learn the symmetric CLIP loss on single images
   and their first sentences against the locked image tower; a ``shuffle_prob`` share of the captions
   has its words shuffled (noisy alt-text), so word order is unreliable and the text tower converges to
   a bag of words (SugarCrepe++-style swap TOT ≈ 0).

Fine-tuning (the authors' ``train.py``): image tower frozen (``freeze_visual``), AdamW with betas
(0.9, 0.98), eps 1e-8, weight decay on matrices only, a linear warm-up over ``warmup_frac`` of the steps
from ``lr_start`` then cosine decay to ``lr_end``, log scale clamped to [0, ln 100] after every step.
Variants:

* ``clip``: the CLIP loss on single images every step.
* ``negclip``: the NegCLIP loss (within-sentence swapped negatives) every step, no alternation (the
  authors' ``trigger_train_negclip.sh``).
* ``clic``: CLIC's loss on concatenated pairs, alternating with the CLIP loss on single images by the
  authors' ``create_normal_clip_loss_pattern(hard_negative_freq)`` (freq 1: CLIC, CLIP, CLIC, ...).
* ``clic_noconcat``: the authors' ``--baseline`` ablation: CLIC's loss and alternation on single images,
  positives (s, s, further sentences), the within-sentence negative.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from central.clic.batches import Sampler
from central.clic.losses import clic_loss, clip_loss, negclip_loss
from central.clic.model import ModelSpec, TinyCLIP, build, freeze_visual
from central.clic.negatives import swap_within
from central.clic.tokens import encode, pad_cat
from central.clic.world import Scene, World, caption_sentences, split_scenes
from fedsim.cache import cache_dir, cached_state, key_of

VARIANTS = ("clip", "negclip", "clic", "clic_noconcat")
CACHE_VERSION = "clic-v1"


@dataclass(frozen=True)
class PretrainSpec:
    """Everything that determines the pretrained CLIP (the cache key)."""

    world: World
    model: ModelSpec
    heldout_frac: float = 0.2
    split_seed: int = 0
    steps: int = 800
    batch: int = 64
    lr: float = 2e-3
    vision_steps: int = 400
    vision_lr: float = 2e-3
    binding: float = 5.0  # weight of the slot (binding) read-out in the vision stage
    shuffle_prob: float = 0.5  # share of text-stage captions with their words shuffled (noisy alt-text)
    seed: int = 0


@dataclass(frozen=True)
class FinetuneSpec:
    variant: str
    steps: int = 300
    batch: int = 64
    lr: float = 2e-4
    lr_start: float = 2e-5
    lr_end: float = 2e-6
    warmup_frac: float = 0.2
    weight_decay: float = 0.1
    cont: float = 0.5
    sneg: float = 0.5
    uni: float = 1.0
    hard_negative_freq: float = 1.0


def lr_at(step: int, steps: int, peak: float, start: float, end: float, warmup_frac: float) -> float:
    """The authors' ``cosine_scheduler``: linear warm-up start → peak, then cosine peak → end."""
    warm = int(warmup_frac * steps)
    if step < warm:
        return start + (peak - start) * step / max(warm - 1, 1)
    t = (step - warm) / max(steps - warm, 1)
    return end + 0.5 * (peak - end) * (1 + math.cos(math.pi * t))


def clip_loss_pattern(freq: float) -> list[bool]:
    """The authors' ``create_normal_clip_loss_pattern``: True = a hard-negative (CLIC) step."""
    if freq == 1:
        return [True, False]
    if freq > 1:
        return [False] + [True] * int(freq)
    return [True] + [False] * int(1 / freq)


def adamw(model: nn.Module, params: list[nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (biases, norms, scalars excluded, as the authors)."""
    ids = {id(p) for p in params}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if id(p) in ids:
            (no_decay if p.ndim < 2 or "bias" in name or "norm" in name or "ln_" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-8)


def _step(model: TinyCLIP, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    model.clamp_scale()


# -- pretraining ------------------------------------------------------------------------------------------

def slot_labels(world: World, scenes: list[Scene]) -> torch.Tensor:
    """(N, 5) class indices: arrangement, first colour, first shape, second colour, second shape."""
    c, sh = world.colours, world.shapes
    return torch.tensor([[int(s.arrangement == "v"), c.index(s.first.colour), sh.index(s.first.shape),
                          c.index(s.second.colour), sh.index(s.second.shape)] for s in scenes])


def slot_loss(head: nn.Linear, feats: torch.Tensor, labels: torch.Tensor, world: World) -> torch.Tensor:
    """Mean cross-entropy of the five slot predictions read linearly from the image embedding."""
    sizes = [2, world.n_colours, world.n_shapes, world.n_colours, world.n_shapes]
    logits = head(feats).split(sizes, dim=1)
    return sum(F.cross_entropy(lg, labels[:, i]) for i, lg in enumerate(logits)) / len(sizes)


def bag_loss(head: nn.Linear, feats: torch.Tensor, scenes: list[Scene], world: World) -> torch.Tensor:
    """Which colours and shapes a scene holds (multi-label BCE) and its arrangement (CE): no binding."""
    c, sh = world.colours, world.shapes
    target = torch.zeros(len(scenes), len(c) + len(sh))
    for i, s in enumerate(scenes):
        for o in (s.first, s.second):
            target[i, c.index(o.colour)] = target[i, len(c) + sh.index(o.shape)] = 1.0
    logits = head(feats)
    arrangement = torch.tensor([int(s.arrangement == "v") for s in scenes])
    return F.binary_cross_entropy_with_logits(logits[:, :-2], target) + F.cross_entropy(logits[:, -2:], arrangement)


def pretrain_vision(model: TinyCLIP, spec: PretrainSpec, sampler: Sampler, rng: np.random.Generator,
                    on_step: Callable[[int, float], None] | None = None) -> None:
    """Stage 1 (a supervised vision backbone): linear read-outs of the image embedding predict which
    colours and shapes a scene holds and its arrangement, plus (weight ``binding``) its five slots --
    which colour and shape is first (left/top) and which second; the read-outs are discarded."""
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed + 1)
        bag = nn.Linear(spec.model.embed, 2 + spec.world.n_colours + spec.world.n_shapes)
        slots = nn.Linear(spec.model.embed, 2 + 2 * spec.world.n_colours + 2 * spec.world.n_shapes)
    vision = nn.ModuleDict({"visual": model.visual, "bag": bag, "slots": slots})
    opt = adamw(vision, list(vision.parameters()), spec.vision_lr, 0.1)
    for step in range(spec.vision_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec.vision_steps, spec.vision_lr, spec.vision_lr / 10, spec.vision_lr / 100,
                                0.05)
        batch = sampler.single(spec.batch, rng)
        feats = model.visual(batch.images)
        loss = bag_loss(bag, feats, batch.scenes, spec.world)
        if spec.binding > 0:
            loss = loss + spec.binding * slot_loss(slots, feats, slot_labels(spec.world, batch.scenes), spec.world)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if on_step is not None:
            on_step(step, float(loss.detach()))


def pretrain_text(model: TinyCLIP, spec: PretrainSpec, sampler: Sampler, rng: np.random.Generator,
                  on_step: Callable[[int, float], None] | None = None) -> None:
    """Stage 2 (LiT-style): the text tower and the logit scale learn the CLIP loss on single images and
    their first sentences against the locked image tower."""
    params = freeze_visual(model)
    opt = adamw(model, params, spec.lr, 0.1)
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec.steps, spec.lr, spec.lr / 10, spec.lr / 100, 0.05)
        batch = sampler.single(spec.batch, rng, spec.shuffle_prob)
        with torch.no_grad():
            img = model.encode_image(batch.images)
        loss = clip_loss(img, model.encode_text(batch.ids), model.scale())
        _step(model, opt, loss)
        if on_step is not None:
            on_step(spec.vision_steps + step, float(loss.detach()))


def pretrain(spec: PretrainSpec, sampler: Sampler, on_step: Callable[[int, float], None] | None = None) -> TinyCLIP:
    """The tiny CLIP from scratch: the vision stage, then the locked-image text stage."""
    model = build(spec.model, spec.seed)
    rng = np.random.default_rng(spec.seed)
    model.train()
    pretrain_vision(model, spec, sampler, rng, on_step)
    pretrain_text(model, spec, sampler, rng, on_step)
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return model


def pretrained_clip(spec: PretrainSpec, sampler: Sampler,
                    on_step: Callable[[int, float], None] | None = None) -> tuple[TinyCLIP, dict[str, float]]:
    """The pretrained CLIP of ``spec`` from the cache, or trained now and cached; and a card
    (``cached``: 1 if loaded, ``pretrain_seconds``)."""
    path = cache_dir() / "clic" / f"clip-{key_of(asdict(spec), CACHE_VERSION)}.pt"
    start = time.perf_counter()
    state, cached = cached_state(path, lambda: pretrain(spec, sampler, on_step).state_dict())
    model = build(spec.model, spec.seed)
    model.load_state_dict(state)
    model.eval()
    return model, {"cached": float(cached), "pretrain_seconds": 0.0 if cached else time.perf_counter() - start}


def make_sampler(world: World, heldout_frac: float, split_seed: int, tok: Tokenizer, n_extra: int,
                 squash: bool = False) -> Sampler:
    """A sampler over the training scenes of the split."""
    return Sampler(world, split_scenes(world, heldout_frac, split_seed)[0], tok, n_extra, squash)


# -- fine-tuning ------------------------------------------------------------------------------------------

def _hard_step_terms(model: TinyCLIP, sampler: Sampler, spec: FinetuneSpec,
                     rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """The CLIC loss terms of one hard-negative step (concatenated pairs, or single images for
    ``clic_noconcat``)."""
    if spec.variant == "clic":
        batch = sampler.clic(spec.batch, rng)
        images, positives, negative = batch.images, batch.positives, batch.negative
    else:
        scenes = sampler.draw(spec.batch, rng)
        caps = [caption_sentences(s, sampler.n_extra, rng) for s in scenes]
        images = sampler.images_of(scenes, rng)
        first = encode(sampler.tok, [c[0].text for c in caps])
        positives = [first, first] + [encode(sampler.tok, [c[j].text for c in caps])
                                      for j in range(1, sampler.n_extra + 1)]
        negative = encode(sampler.tok, [swap_within(c[0], rng)[0].text for c in caps])
    with torch.no_grad():
        img = model.encode_image(images)
    n = len(img)
    txt = model.encode_text(pad_cat([*positives, negative]))
    sets = [txt[i * n:(i + 1) * n] for i in range(len(positives))]
    return clic_loss(img, sets, txt[len(positives) * n:], model.scale(), spec.cont, spec.sneg, spec.uni)


def finetune(model: TinyCLIP, sampler: Sampler, spec: FinetuneSpec, rng: np.random.Generator,
             on_step: Callable[[int, dict[str, float]], None] | None = None) -> TinyCLIP:
    """Fine-tune the text side of ``model`` in place (image tower frozen) with ``spec.variant``."""
    params = freeze_visual(model)
    opt = adamw(model, params, spec.lr, spec.weight_decay)
    pattern = clip_loss_pattern(spec.hard_negative_freq)
    model.train()
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec.steps, spec.lr, spec.lr_start, spec.lr_end, spec.warmup_frac)
        hard = spec.variant in ("clic", "clic_noconcat") and pattern[step % len(pattern)]
        if hard:
            terms = _hard_step_terms(model, sampler, spec, rng)
        elif spec.variant == "negclip":
            images, pos, neg = sampler.negclip(spec.batch, rng)
            with torch.no_grad():
                img = model.encode_image(images)
            txt = model.encode_text(pad_cat([pos, neg]))
            terms = {"total": negclip_loss(img, txt[:len(img)], txt[len(img):], model.scale())}
        else:
            batch = sampler.single(spec.batch, rng)
            with torch.no_grad():
                img = model.encode_image(batch.images)
            terms = {"total": clip_loss(img, model.encode_text(batch.ids), model.scale())}
        _step(model, opt, terms["total"])
        if on_step is not None:
            kind = "clic" if hard else ("negclip" if spec.variant == "negclip" else "clip")
            on_step(step, {f"{kind}/{k}": float(v.detach()) for k, v in terms.items()})
    model.eval()
    return model
