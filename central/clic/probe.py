"""Can the frozen image tower tell a scene (or a stacked pair) from its hard negative at all?

An oracle text tower that puts every caption at the mean image embedding of the scenes it describes
(its *centroid*, over ``renders`` fresh renders) is the best text tower consistent with the frozen image
tower that needs no training.  Its accuracy -- a fresh render is closer (cosine) to its own caption's
centroid than to the negative's -- bounds what fine-tuning the text tower can reach against that image
tower:

* ``pair_oracle``: stacked training pairs against CLIC's between-sentence swapped twin (the signal of
  CLIC's hard-negative term; per swapped slot type as ``pair_oracle/colour|shape|relation``);
* ``itt_oracle``: held-out single scenes against the evaluation negatives (an ITT ceiling; per type).

``*_gap`` is the mean cosine margin cos(x, own) − cos(x, negative) (× the logit scale, ≤ 100, it is the
logit margin the hard-negative cross-entropy would see).
"""

from __future__ import annotations

import numpy as np
import torch

from central.clic.batches import stack_pair
from central.clic.model import TinyCLIP
from central.clic.negatives import EVAL_TYPES, eval_negative, swap_between
from central.clic.world import RELATIONS, Obj, Scene, Sentence, World, render, sentence


def scene_of(s: Sentence) -> Scene:
    """The scene a sentence describes ("left of"/"above": the subject is first)."""
    subj, obj, rel = Obj(s.slot("c1"), s.slot("s1")), Obj(s.slot("c2"), s.slot("s2")), s.slot("rel")
    arrangement = "h" if rel in RELATIONS["h"] else "v"
    return Scene(arrangement, subj, obj) if rel in ("left of", "above") else Scene(arrangement, obj, subj)


@torch.no_grad()
def _embed(model: TinyCLIP, world: World, items: list[tuple[Scene, ...]], rng: np.random.Generator,
           squash: bool) -> torch.Tensor:
    """Normalised embeddings of one render of each item (a scene, or a pair stacked in random order)."""
    first = torch.from_numpy(render(world, [t[0] for t in items], rng)[0])
    if len(items[0]) == 1:
        return model.encode_image(first)
    second = torch.from_numpy(render(world, [t[1] for t in items], rng)[0])
    return model.encode_image(stack_pair(first, second, rng, squash))


def oracle(model: TinyCLIP, world: World, pos: list[tuple[Scene, ...]], neg: list[tuple[Scene, ...]],
           renders: int, rng: np.random.Generator, squash: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per item: (a fresh render is closer to its centroid than to the negative's, the cosine margin)."""
    def centroid(items: list[tuple[Scene, ...]]) -> torch.Tensor:
        c = sum(_embed(model, world, items, rng, squash) for _ in range(renders))
        return torch.nn.functional.normalize(c, dim=-1)

    query, c_pos, c_neg = _embed(model, world, pos, rng, squash), centroid(pos), centroid(neg)
    gap = (query * c_pos).sum(-1) - (query * c_neg).sum(-1)
    return (gap > 0).numpy(), gap.numpy()


def probe(model: TinyCLIP, world: World, train: list[Scene], heldout: list[Scene], pairs: int, renders: int,
          rng: np.random.Generator, squash: bool = False) -> dict[str, float]:
    """``pair_oracle``/``itt_oracle`` (and per type) with their ``*_gap`` (see the module docstring)."""
    out: dict[str, float] = {}
    pos, neg, kinds = [], [], []
    while len(pos) < pairs:  # CLIC's pairs: a partner redrawn until some slot type can be swapped
        a, b = (train[i] for i in rng.integers(len(train), size=2))
        s1, s2 = sentence(a, "a", int(rng.integers(2))), sentence(b, "a", int(rng.integers(2)))
        swapped = swap_between(s1, s2, rng)
        if swapped is not None:
            pos.append((a, b))
            neg.append((scene_of(swapped[0]), scene_of(swapped[1])))
            kinds.append(swapped[2])
    hit, gap = oracle(model, world, pos, neg, renders, rng, squash)
    out["pair_oracle"], out["pair_gap"] = float(hit.mean()), float(gap.mean())
    for kind in ("colour", "shape", "relation"):
        rows = np.array([k == kind for k in kinds])
        out[f"pair_oracle/{kind}"] = float(hit[rows].mean()) if rows.any() else float("nan")
    for kind in EVAL_TYPES:
        p1 = [sentence(s, "a", int(rng.integers(2))) for s in heldout]
        negs = [(scene_of(eval_negative(p, kind, world.colours, world.shapes, rng)),) for p in p1]
        hit, gap = oracle(model, world, [(s,) for s in heldout], negs, renders, rng)
        out[f"itt_oracle/{kind}"], out[f"itt_gap/{kind}"] = float(hit.mean()), float(gap.mean())
    out["itt_oracle"] = float(np.mean([out[f"itt_oracle/{k}"] for k in EVAL_TYPES]))
    out["itt_gap"] = float(np.mean([out[f"itt_gap/{k}"] for k in EVAL_TYPES]))
    return out
