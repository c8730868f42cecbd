"""Training batches of the three kinds: single images (CLIP), single images with a within-sentence hard
negative (NegCLIP), and CLIC's concatenated image pairs with their positive sets and negative.

CLIC (the authors' ``CombineCsvDataset.__getitem__``): a second image is drawn at random, both are
resized to half height (square images are "wider" in the authors' code) and stacked vertically in a
random order, independent of the caption order.  With first sentences s1, s2 and further sentences:
p1 = s1 ⊕ s2, p2 = s2 ⊕ s1, p3/p4 = the j-th further sentences of the two captions joined in random
order, negative = the two first sentences after a between-sentence swap, joined in random order.  The
single-image step of the same batch uses the first image and its first sentence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from central.clic.negatives import swap_between, swap_within
from central.clic.tokens import encode
from central.clic.world import Scene, Sentence, World, caption_sentences, concat_text, render


def random_concat(a: Sentence, b: Sentence, rng: np.random.Generator) -> str:
    """The two sentences joined in a random order (the authors' ``random_concat``)."""
    return concat_text([a, b] if rng.integers(2) == 0 else [b, a])


def stack_pair(first: torch.Tensor, second: torch.Tensor, rng: np.random.Generator, squash: bool) -> torch.Tensor:
    """The two images stacked vertically, the first on top with probability 1/2.  ``squash``: each is
    first resized to half height (bicubic, antialiased), so the pair has the input size (the authors'
    pipeline); otherwise the pair is twice as high."""
    n, _, h, w = first.shape
    pair = torch.cat([first, second])
    if squash:
        pair = F.interpolate(pair, size=(h // 2, w), mode="bicubic", antialias=True, align_corners=False)
        pair = pair.clamp(0.0, 1.0)
    top_first = torch.as_tensor(rng.integers(2, size=n) == 0)[:, None, None, None]
    a, b = pair[:n], pair[n:]
    return torch.cat([torch.where(top_first, a, b), torch.where(top_first, b, a)], dim=2)


def scramble(text: str, rng: np.random.Generator) -> str:
    """The words of a one-sentence caption in a random order (its final period kept last)."""
    words = text.split()[:-1]
    return " ".join([words[i] for i in rng.permutation(len(words))] + ["."])


@dataclass
class SingleBatch:
    images: torch.Tensor  # (B, 3, S, S)
    ids: torch.Tensor  # token ids of the first sentences (B × L)
    sentences: list[Sentence]
    scenes: list[Scene]


@dataclass
class ClicBatch:
    images: torch.Tensor  # concatenated pairs (B, 3, S, S)
    positives: list[torch.Tensor]  # token ids of p1, p2, p3, ... (each B × L)
    negative: torch.Tensor  # token ids of the swapped captions (B × L)
    single_images: torch.Tensor  # the first image of each pair, for the CLIP step
    single_ids: torch.Tensor  # its first sentence
    texts: dict[str, list[str]]  # the captions as text, for figures


class Sampler:
    """Draws training scenes uniformly and builds the batches (all randomness from the given rng)."""

    def __init__(self, world: World, scenes: list[Scene], tok: Tokenizer, n_extra: int, squash: bool = False) -> None:
        self.world, self.scenes, self.tok, self.n_extra, self.squash = world, scenes, tok, n_extra, squash

    def draw(self, n: int, rng: np.random.Generator) -> list[Scene]:
        return [self.scenes[i] for i in rng.integers(len(self.scenes), size=n)]

    def images_of(self, scenes: list[Scene], rng: np.random.Generator) -> torch.Tensor:
        return torch.from_numpy(render(self.world, scenes, rng)[0])

    def single(self, n: int, rng: np.random.Generator, shuffle_prob: float = 0.0) -> SingleBatch:
        """Images with their first sentences; with probability ``shuffle_prob`` a caption's words come in
        a random order (noisy alt-text: the pretraining captions)."""
        scenes = self.draw(n, rng)
        firsts = [caption_sentences(s, 0, rng)[0] for s in scenes]
        texts = [scramble(s.text, rng) if shuffle_prob > 0 and rng.random() < shuffle_prob else s.text for s in firsts]
        return SingleBatch(self.images_of(scenes, rng), encode(self.tok, texts), firsts, scenes)

    def negclip(self, n: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Images, positive ids, and ids of each caption with two same-type words swapped."""
        batch = self.single(n, rng)
        negs = [swap_within(s, rng)[0].text for s in batch.sentences]
        return batch.images, batch.ids, encode(self.tok, negs)

    def clic(self, n: int, rng: np.random.Generator) -> ClicBatch:
        """Concatenated pairs; a partner is redrawn until some slot type can be swapped with it."""
        firsts_scenes = self.draw(n, rng)
        caps1 = [caption_sentences(s, self.n_extra, rng) for s in firsts_scenes]
        partners, caps2, negs = [], [], []
        for cap1 in caps1:
            while True:
                scene2 = self.draw(1, rng)[0]
                cap2 = caption_sentences(scene2, self.n_extra, rng)
                swapped = swap_between(cap1[0], cap2[0], rng)
                if swapped is not None:
                    break
            partners.append(scene2)
            caps2.append(cap2)
            negs.append(random_concat(swapped[0], swapped[1], rng))
        texts = {"p1": [concat_text([a[0], b[0]]) for a, b in zip(caps1, caps2)],
                 "p2": [concat_text([b[0], a[0]]) for a, b in zip(caps1, caps2)]}
        for j in range(1, self.n_extra + 1):
            texts[f"p{j + 2}"] = [random_concat(a[j], b[j], rng) for a, b in zip(caps1, caps2)]
        texts["negative"] = negs
        img1, img2 = self.images_of(firsts_scenes, rng), self.images_of(partners, rng)
        return ClicBatch(
            images=stack_pair(img1, img2, rng, self.squash),
            positives=[encode(self.tok, texts[f"p{i}"]) for i in range(1, self.n_extra + 3)],
            negative=encode(self.tok, negs),
            single_images=img1,
            single_ids=encode(self.tok, [c[0].text for c in caps1]),
            texts=texts,
        )
