"""SugarCrepe++-style compositionality and retrieval on held-out scenes.

For every held-out scene (and render) and every negative type: p1 = the "a …" phrasing in a random
orientation, p2 = the "the … is …" phrasing in the other orientation (same meaning, different words and
order), and a negative of p1 (:func:`central.clic.negatives.eval_negative`).  ITT is right when the
image is closer (cosine) to both p1 and p2 than to the negative; TOT when cos(p1, p2) exceeds both
cos(p1, neg) and cos(p2, neg) (the authors' ``sugarcrepe_pp_evaluate``).  Retrieval: one render of each
held-out scene with a random phrasing; recall@K image→text and text→image (the scenes are distinct,
so each query has exactly one match).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from central.clic.model import TinyCLIP
from central.clic.negatives import EVAL_TYPES, eval_negative
from central.clic.tokens import encode
from central.clic.world import Scene, World, caption_sentences, render, sentence


@dataclass
class EvalSet:
    """Pre-tokenised evaluation data (built once per run, shared by every model)."""

    triplet_images: torch.Tensor  # (M, 3, S, S)
    p1: torch.Tensor
    p2: torch.Tensor
    negatives: dict[str, torch.Tensor]  # type -> ids (M × L)
    retrieval_images: torch.Tensor  # (R, 3, S, S)
    retrieval_ids: torch.Tensor  # (R × L)
    examples: list[dict[str, str]]  # a few triplets as text, for the figure
    example_images: torch.Tensor  # their images


def build_eval_set(world: World, scenes: list[Scene], tok: Tokenizer, renders: int,
                   rng: np.random.Generator) -> EvalSet:
    """Triplets for ``renders`` images of every held-out scene, and a retrieval set of one image each."""
    tri_scenes = [s for s in scenes for _ in range(renders)]
    images = torch.from_numpy(render(world, tri_scenes, rng)[0])
    orient = rng.integers(2, size=len(tri_scenes))
    p1 = [sentence(s, "a", int(o)) for s, o in zip(tri_scenes, orient)]
    p2 = [sentence(s, "the", 1 - int(o)) for s, o in zip(tri_scenes, orient)]
    negs = {kind: [eval_negative(p, kind, world.colours, world.shapes, rng) for p in p1] for kind in EVAL_TYPES}
    shown = list(range(0, len(p1), renders))[:4]  # one render of each of the first scenes
    examples = [{"p1": p1[i].text, "p2": p2[i].text, **{k: negs[k][i].text for k in EVAL_TYPES}} for i in shown]
    ret_images = torch.from_numpy(render(world, scenes, rng)[0])
    ret_texts = [caption_sentences(s, 0, rng)[0].text for s in scenes]
    return EvalSet(images, encode(tok, [p.text for p in p1]), encode(tok, [p.text for p in p2]),
                   {k: encode(tok, [n.text for n in v]) for k, v in negs.items()}, ret_images,
                   encode(tok, ret_texts), examples, images[shown])


def _embed_text(model: TinyCLIP, ids: torch.Tensor, batch: int = 512) -> torch.Tensor:
    return torch.cat([model.encode_text(ids[i:i + batch]) for i in range(0, len(ids), batch)])


def _embed_images(model: TinyCLIP, images: torch.Tensor, batch: int = 512) -> torch.Tensor:
    return torch.cat([model.encode_image(images[i:i + batch]) for i in range(0, len(images), batch)])


def sugarcrepe_pp(img: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor, neg: torch.Tensor) -> tuple[float, float]:
    """(ITT, TOT) accuracy of normalised embeddings (rows are the triplets)."""
    cos = lambda a, b: (a * b).sum(-1)  # noqa: E731
    itt = (cos(img, p1) > cos(img, neg)) & (cos(img, p2) > cos(img, neg))
    tot = (cos(p1, p2) > cos(p1, neg)) & (cos(p1, p2) > cos(p2, neg))
    return float(itt.float().mean()), float(tot.float().mean())


def recall_at(sims: torch.Tensor, k: int) -> float:
    """Fraction of rows whose diagonal entry is among the row's k largest."""
    rank = (sims > sims.diagonal()[:, None]).sum(1)
    return float((rank < k).float().mean())


@torch.no_grad()
def evaluate(model: TinyCLIP, data: EvalSet) -> dict[str, float]:
    """ITT/TOT per negative type and averaged (``itt_acc``, ``tot_acc``), and R@1/R@5 both ways."""
    model.eval()
    img = _embed_images(model, data.triplet_images)
    p1, p2 = _embed_text(model, data.p1), _embed_text(model, data.p2)
    out: dict[str, float] = {}
    for kind, ids in data.negatives.items():
        out[f"itt/{kind}"], out[f"tot/{kind}"] = sugarcrepe_pp(img, p1, p2, _embed_text(model, ids))
    out["itt_acc"] = float(np.mean([out[f"itt/{k}"] for k in data.negatives]))
    out["tot_acc"] = float(np.mean([out[f"tot/{k}"] for k in data.negatives]))
    sims = _embed_images(model, data.retrieval_images) @ _embed_text(model, data.retrieval_ids).T
    for k in (1, 5):
        out[f"r{k}_i2t"], out[f"r{k}_t2i"] = recall_at(sims, k), recall_at(sims.T, k)
    out["r1_mean"] = (out["r1_i2t"] + out["r1_t2i"]) / 2
    return out
