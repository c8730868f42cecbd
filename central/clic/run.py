"""The ``clic`` experiment: pretrain a tiny CLIP on the two-object world, fine-tune its text tower with
each variant from the same pretrained weights, and compare compositionality and retrieval.

Steps: build the world and split its scenes (held-out compositions); load or pretrain the CLIP (cached);
evaluate it (the ``pretrained`` reference); for each variant, fine-tune a copy (image tower frozen) and
evaluate it on the same held-out triplets and retrieval set.  Headline: the first variant's ``eval/*``
metrics; every model's numbers (``pretrained`` included) carry its name as a prefix, and ``probe/*`` is
the centroid-oracle probe of the frozen image tower (:mod:`central.clic.probe`: can it tell a stacked pair
from its between-sentence swapped twin, and a held-out scene from its evaluation negatives, at all?).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from fedsim.contracts.central import CentralContext
from central.clic.batches import Sampler
from central.clic.evaluate import EvalSet, build_eval_set, evaluate
from central.clic.model import ModelSpec, TinyCLIP
from central.clic.negatives import EVAL_TYPES
from central.clic.probe import probe
from central.clic.plots import plot_losses, plot_per_type, plot_samples, plot_variants
from central.clic.tokens import word_tokenizer
from central.clic.train import VARIANTS, FinetuneSpec, PretrainSpec, finetune, make_sampler, pretrained_clip
from central.clic.world import COLOURS, SHAPES, World, split_scenes
from fedsim.errors import ConfigError
from fedsim.registry import CENTRAL
from fedsim.threads import torch_threads

PAIR_LAYOUTS = ("stack", "squash")
HEADLINE = ("itt_acc", "tot_acc", "r1_i2t", "r1_t2i", "r5_i2t", "r5_t2i")
MAX_LEN = 24  # two "the ..." sentences with periods and <cls> take 21 tokens


@dataclass
class ClicParams:
    variants: list[str] = field(default_factory=lambda: ["clic", "negclip", "clip"])  # the first: headline keys
    # fine-tuning (the authors' recipe; lr scaled up for a model trained from scratch in minutes)
    steps: int = 200
    batch: int = 64
    lr: float = 2e-3
    lr_start: float = 2e-4  # warm-up start (authors: lr / 10)
    lr_end: float = 2e-5  # cosine end (authors: lr / 100)
    warmup_frac: float = 0.2
    weight_decay: float = 0.1
    cont: float = 0.5  # Eq. 7 weights
    sneg: float = 0.5
    uni: float = 1.0
    hard_negative_freq: float = 1.0  # CLIC steps per plain-CLIP step (the authors' pattern)
    additional_positives: int = 2  # p3, p4 (0..2)
    # the world
    n_colours: int = 6
    n_shapes: int = 5
    image_size: int = 32
    noise: float = 0.02
    heldout_frac: float = 0.2  # unordered object pairs held out (all their scenes)
    split_seed: int = 0
    eval_renders: int = 2  # triplet images per held-out scene
    # the tiny CLIP and its pretraining (cached by all of these and the seed)
    embed: int = 64
    width: int = 64
    layers: int = 2
    heads: int = 4
    channels: list[int] = field(default_factory=lambda: [16, 32, 64])
    vision_steps: int = 400  # stage 1: supervised image tower (object-role read-out)
    vision_lr: float = 2e-3
    binding: float = 5.0  # stage-1 weight of the slot read-out (which colour/shape is where); 0: bag only
    pretrain_steps: int = 800  # stage 2: text tower against the locked image tower (CLIP loss)
    pretrain_batch: int = 64
    pretrain_lr: float = 2e-3
    shuffle_prob: float = 0.5  # stage-2 captions with shuffled words (noisy alt-text)
    pair_layout: str = "stack"  # stack (pair twice as high) | squash (the authors' resize to half height)
    log_every: int = 20
    probe_pairs: int = 256  # stacked training pairs of the image-tower probe (0: no probe)
    probe_renders: int = 16  # renders averaged into each caption's centroid


def check(p: ClicParams) -> None:
    if not p.variants or len(set(p.variants)) != len(p.variants) or set(p.variants) - set(VARIANTS):
        raise ConfigError(f"params.variants must be distinct names from {list(VARIANTS)}, got {p.variants}")
    for name in ("steps", "batch", "vision_steps", "pretrain_steps", "pretrain_batch", "eval_renders", "embed",
                 "width", "layers", "heads", "log_every", "probe_renders"):
        if getattr(p, name) < 1:
            raise ConfigError(f"params.{name} must be >= 1, got {getattr(p, name)}")
    if min(p.batch, p.pretrain_batch) < 2:
        raise ConfigError(f"params.batch and params.pretrain_batch must be >= 2 (contrastive), got {p.batch}, "
                          f"{p.pretrain_batch}")
    for name in ("lr", "lr_start", "lr_end", "vision_lr", "pretrain_lr", "hard_negative_freq"):
        if not getattr(p, name) > 0:
            raise ConfigError(f"params.{name} must be > 0, got {getattr(p, name)}")
    for name in ("weight_decay", "cont", "sneg", "uni", "noise", "binding"):
        if getattr(p, name) < 0:
            raise ConfigError(f"params.{name} must be >= 0, got {getattr(p, name)}")
    if p.probe_pairs < 0:
        raise ConfigError(f"params.probe_pairs must be >= 0 (0: no probe), got {p.probe_pairs}")
    if not 0 <= p.shuffle_prob < 1:
        raise ConfigError(f"params.shuffle_prob must be in [0, 1), got {p.shuffle_prob}")
    if p.pair_layout not in PAIR_LAYOUTS:
        raise ConfigError(f"params.pair_layout must be one of {list(PAIR_LAYOUTS)}, got {p.pair_layout!r}")
    if not 0 <= p.warmup_frac < 1:
        raise ConfigError(f"params.warmup_frac must be in [0, 1), got {p.warmup_frac}")
    if not 0 <= p.additional_positives <= 2:
        raise ConfigError(f"params.additional_positives must be 0, 1 or 2 (a scene has 4 phrasings), "
                          f"got {p.additional_positives}")
    if not 3 <= p.n_colours <= len(COLOURS) or not 3 <= p.n_shapes <= len(SHAPES):
        raise ConfigError(f"params.n_colours must be in [3, {len(COLOURS)}] and params.n_shapes in "
                          f"[3, {len(SHAPES)}], got {p.n_colours}, {p.n_shapes}")
    if p.image_size < 16 or p.image_size % 8:
        raise ConfigError(f"params.image_size must be a multiple of 8 and >= 16, got {p.image_size}")
    if not 0 < p.heldout_frac < 1:
        raise ConfigError(f"params.heldout_frac must be in (0, 1), got {p.heldout_frac}")
    if p.width % p.heads:
        raise ConfigError(f"params.width ({p.width}) must be divisible by params.heads ({p.heads})")
    if len(p.channels) != 3 or min(p.channels) < 1:
        raise ConfigError(f"params.channels must be three positive conv widths, got {p.channels}")
    train, held = split_scenes(World(p.n_colours, p.n_shapes, p.image_size, p.noise), p.heldout_frac, p.split_seed)
    if len(held) < 5 or len(train) < p.pretrain_batch // 4:
        raise ConfigError(f"params.heldout_frac={p.heldout_frac} leaves {len(train)} training and {len(held)} "
                          f"held-out scenes; both must be non-trivial")


def _specs(p: ClicParams, vocab: int, seed: int) -> tuple[World, PretrainSpec]:
    world = World(p.n_colours, p.n_shapes, p.image_size, p.noise)
    model = ModelSpec(vocab=vocab, max_len=MAX_LEN, embed=p.embed, width=p.width, layers=p.layers, heads=p.heads,
                      channels=tuple(p.channels))
    return world, PretrainSpec(world, model, p.heldout_frac, p.split_seed, p.pretrain_steps, p.pretrain_batch,
                               p.pretrain_lr, p.vision_steps, p.vision_lr, p.binding, p.shuffle_prob, seed)


def _finetune_spec(p: ClicParams, variant: str) -> FinetuneSpec:
    return FinetuneSpec(variant, p.steps, p.batch, p.lr, p.lr_start, p.lr_end, p.warmup_frac, p.weight_decay,
                        p.cont, p.sneg, p.uni, p.hard_negative_freq)


def _row(name: str, m: dict[str, float]) -> dict[str, object]:
    return {"model": name, **{k: round(m[k], 4) for k in (*HEADLINE, "r1_mean")}}


def _type_rows(name: str, m: dict[str, float]) -> list[dict[str, object]]:
    return [{"model": name, "negative": k, "itt": round(m[f"itt/{k}"], 4), "tot": round(m[f"tot/{k}"], 4)}
            for k in EVAL_TYPES]


@CENTRAL.register("clic", params=ClicParams,
                  summary="CLIC (arXiv 2505.24424): concatenated-pair text-tower fine-tuning of a tiny CLIP "
                          "vs CLIP/NegCLIP")
def run_clic(ctx: CentralContext) -> dict[str, float]:
    p: ClicParams = ctx.params
    with torch_threads(1):
        world = World(p.n_colours, p.n_shapes, p.image_size, p.noise)
        tok = word_tokenizer(world, MAX_LEN)
        world, pre_spec = _specs(p, tok.get_vocab_size(), ctx.seed("pretrain"))
        sampler = make_sampler(world, p.heldout_frac, p.split_seed, tok, p.additional_positives,
                               p.pair_layout == "squash")
        heldout = split_scenes(world, p.heldout_frac, p.split_seed)[1]
        with ctx.progress(p.vision_steps + p.pretrain_steps, "clic: pretraining the tiny CLIP") as bar:
            base, card = pretrained_clip(pre_spec, sampler, lambda step, loss: bar.advance())
        eval_set = build_eval_set(world, heldout, tok, p.eval_renders, ctx.rng("eval"))
        results = {"pretrained": evaluate(base, eval_set)}
        probed = probe(base, world, sampler.scenes, heldout, p.probe_pairs, p.probe_renders, ctx.rng("probe"),
                       p.pair_layout == "squash") if p.probe_pairs else {}
        curves: dict[str, list[tuple[int, float]]] = {}
        for variant in p.variants:
            results[variant] = _run_variant(ctx, base, sampler, _finetune_spec(p, variant), eval_set, curves)
    _log(ctx, p, results, curves, eval_set, sampler, card, len(sampler.scenes), len(heldout))
    first = results[p.variants[0]]
    headline = {f"eval/{k}": first[k] for k in (*HEADLINE, "r1_mean")}
    headline |= {f"eval/itt/{k}": first[f"itt/{k}"] for k in EVAL_TYPES}
    headline |= {f"eval/tot/{k}": first[f"tot/{k}"] for k in EVAL_TYPES}
    for name, m in results.items():
        headline |= {f"{name}/{k}": m[k] for k in (*HEADLINE, "r1_mean")}
    headline |= {f"probe/{k}": v for k, v in probed.items()}
    headline["retrieval/chance_r1"] = 1.0 / len(heldout)  # one match among the held-out scenes
    return headline


def _run_variant(ctx: CentralContext, base: TinyCLIP, sampler: Sampler, spec: FinetuneSpec, eval_set: EvalSet,
                 curves: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """Fine-tune a copy of ``base`` with one variant (logging its loss terms) and evaluate it."""
    model = copy.deepcopy(base)
    p: ClicParams = ctx.params

    def on_step(step: int, terms: dict[str, float]) -> None:
        bar.advance()
        kind = next(iter(terms)).split("/")[0]  # clip | negclip | clic: the loss of this step
        curves.setdefault(f"{spec.variant}: {kind} loss", []).append((step, terms[f"{kind}/total"]))
        if step % p.log_every < 2 or step == spec.steps - 1:  # CLIC alternates: log both kinds of step
            ctx.log_metrics({f"train/{spec.variant}/{k}": v for k, v in terms.items()}, step)

    with ctx.progress(spec.steps, f"clic: fine-tuning ({spec.variant})") as bar:
        finetune(model, sampler, spec, ctx.rng("finetune", spec.variant), on_step)
    return evaluate(model, eval_set)


def _log(ctx: CentralContext, p: ClicParams, results: dict[str, dict[str, float]],
         curves: dict[str, list[tuple[int, float]]], eval_set: EvalSet, sampler: Sampler, card: dict[str, float],
         n_train: int, n_held: int) -> None:
    ctx.log_table([_row(name, m) for name, m in results.items()], "variants")
    ctx.log_table([r for name, m in results.items() for r in _type_rows(name, m)], "per_type")
    ctx.log_figure(plot_variants(results), "variants")
    ctx.log_figure(plot_per_type(results), "per_type")
    ctx.log_figure(plot_losses({k: v for k, v in curves.items() if v}), "finetune_loss")
    sample = sampler.clic(4, ctx.rng("figure"))
    ctx.log_figure(plot_samples(eval_set.example_images, eval_set.examples, sample.images,
                                sample.texts), "samples")
    ctx.log_params({"clic/train_scenes": n_train, "clic/heldout_scenes": n_held,
                    "clic/pretrained_from_cache": bool(card["cached"]),
                    "clic/pretrain_seconds": round(card["pretrain_seconds"], 1)})


run_clic.check = check  # type: ignore[attr-defined]
