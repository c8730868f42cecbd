"""The synthetic two-object world: scenes, their rendering, and captions with known slots.

A scene holds two objects (a colour and a shape each; the two differ in both) in one of two
arrangements: ``h`` (the first object left, the second right) or ``v`` (the first on top, the second
below).  :func:`render` draws scenes as small RGB images; :func:`phrasings` gives the four captions of a
scene (two templates × two orientations), each a :class:`Sentence` whose chunks carry their slot
(``c1``/``s1``: the subject's colour and shape, ``rel``, ``c2``/``s2``: the object's), so negatives
are built from slots and need no parser.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

#: colour name -> RGB in [0, 1]; the world uses the first ``n_colours``.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1), "green": (0.1, 0.75, 0.1), "blue": (0.15, 0.3, 1.0), "yellow": (0.95, 0.9, 0.1),
    "purple": (0.65, 0.15, 0.9), "cyan": (0.1, 0.85, 0.9), "orange": (1.0, 0.55, 0.05), "white": (0.95, 0.95, 0.95),
}
#: the shapes, in order; the world uses the first ``n_shapes``.
SHAPES = ("square", "circle", "triangle", "cross", "diamond")
#: arrangement -> (relation of the first object to the second, its inverse).
RELATIONS = {"h": ("left of", "right of"), "v": ("above", "below")}
ALL_RELATIONS = ("left of", "right of", "above", "below")
TEMPLATES = ("a", "the")  # "a C S REL a C S" | "the C S is REL the C S"
SLOT_TYPE = {"c1": "colour", "c2": "colour", "s1": "shape", "s2": "shape", "rel": "relation"}
FUNCTION_WORDS = ("a", "the", "is", ".")


@dataclass(frozen=True)
class Obj:
    colour: str
    shape: str


@dataclass(frozen=True)
class Scene:
    """Two objects; ``first`` is left (``h``) or on top (``v``) of ``second``."""

    arrangement: str
    first: Obj
    second: Obj


@dataclass(frozen=True)
class World:
    """The vocabulary of the world and its image size."""

    n_colours: int = 6
    n_shapes: int = 5
    size: int = 32
    noise: float = 0.02  # std of the pixel noise (0: clean images)

    @property
    def colours(self) -> tuple[str, ...]:
        return tuple(COLOURS)[: self.n_colours]

    @property
    def shapes(self) -> tuple[str, ...]:
        return SHAPES[: self.n_shapes]

    def words(self) -> list[str]:
        """Every word a caption of this world can use."""
        rel_words = sorted({w for r in ALL_RELATIONS for w in r.split()})
        return [*FUNCTION_WORDS, *rel_words, *self.colours, *self.shapes]

    def scenes(self) -> list[Scene]:
        """All scenes: arrangements × ordered pairs of objects differing in colour and in shape."""
        objs = [Obj(c, s) for c in self.colours for s in self.shapes]
        return [Scene(a, o1, o2) for a in RELATIONS for o1, o2 in itertools.permutations(objs, 2)
                if o1.colour != o2.colour and o1.shape != o2.shape]


def split_scenes(world: World, heldout_frac: float, seed: int) -> tuple[list[Scene], list[Scene]]:
    """(train, held-out) scenes: a seeded ``heldout_frac`` of the unordered object pairs is held out
    with all four of its scenes (both arrangements, both orders), so held-out images show
    compositions never seen in training."""
    scenes = world.scenes()
    pairs = sorted({frozenset((s.first, s.second)) for s in scenes},
                   key=lambda p: sorted((o.colour, o.shape) for o in p))
    rng = np.random.default_rng(seed)
    n_held = int(round(heldout_frac * len(pairs)))
    held = {pairs[i] for i in rng.permutation(len(pairs))[:n_held]}
    train = [s for s in scenes if frozenset((s.first, s.second)) not in held]
    heldout = [s for s in scenes if frozenset((s.first, s.second)) in held]
    return train, heldout


# -- captions -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sentence:
    """A caption sentence as (slot or None, words) chunks; ``text`` ends with " ."."""

    chunks: tuple[tuple[str | None, str], ...]

    @property
    def text(self) -> str:
        return " ".join(w for _, w in self.chunks) + " ."

    def slot(self, name: str) -> str:
        return next(w for s, w in self.chunks if s == name)

    def with_slots(self, **values: str) -> "Sentence":
        """The sentence with the named slots' words replaced."""
        return replace(self, chunks=tuple((s, values.get(s, w) if s else w) for s, w in self.chunks))


def sentence(scene: Scene, template: str, orientation: int) -> Sentence:
    """One phrasing: orientation 0 names ``first`` as the subject, 1 names ``second`` (inverse relation)."""
    subj, obj = (scene.first, scene.second) if orientation == 0 else (scene.second, scene.first)
    rel = RELATIONS[scene.arrangement][orientation]
    if template == "a":
        chunks = [(None, "a"), ("c1", subj.colour), ("s1", subj.shape), ("rel", rel),
                  (None, "a"), ("c2", obj.colour), ("s2", obj.shape)]
    else:
        chunks = [(None, "the"), ("c1", subj.colour), ("s1", subj.shape), (None, "is"), ("rel", rel),
                  (None, "the"), ("c2", obj.colour), ("s2", obj.shape)]
    return Sentence(tuple(chunks))


def phrasings(scene: Scene) -> list[Sentence]:
    """The four captions of a scene (templates × orientations), all true."""
    return [sentence(scene, t, o) for t in TEMPLATES for o in (0, 1)]


def caption_sentences(scene: Scene, n_extra: int, rng: np.random.Generator) -> list[Sentence]:
    """A scene's caption as sentences: a random first phrasing and ``n_extra`` other phrasings
    (the stand-in for the further sentences of a long caption, the source of p3/p4)."""
    order = rng.permutation(4)
    options = phrasings(scene)
    return [options[i] for i in order[: 1 + n_extra]]


def concat_text(sentences: list[Sentence]) -> str:
    """Sentences joined in the given order (each ends with its period, as the authors' concat_texts)."""
    return " ".join(s.text for s in sentences)


# -- rendering ----------------------------------------------------------------------------------------

def shape_mask(shape: str, dx: np.ndarray, dy: np.ndarray, r: np.ndarray) -> np.ndarray:
    """The pixels of ``shape`` with half-size ``r`` at offsets (dx, dy) from its centre."""
    ax, ay = np.abs(dx), np.abs(dy)
    if shape == "square":
        return (ax <= 0.8 * r) & (ay <= 0.8 * r)
    if shape == "circle":
        return dx ** 2 + dy ** 2 <= r ** 2
    if shape == "triangle":  # apex up
        return (dy >= -r) & (dy <= r) & (ax <= (dy + r) / 2)
    if shape == "cross":
        return ((ax <= r / 3) & (ay <= r)) | ((ay <= r / 3) & (ax <= r))
    if shape == "diamond":
        return ax + ay <= r
    raise ValueError(f"unknown shape {shape!r}")


@dataclass
class Geometry:
    """Where each object of each rendered scene is: centres (N, 2, 2) as (x, y) and radii (N, 2)."""

    centres: np.ndarray
    radii: np.ndarray
    masks: np.ndarray  # (N, 2, S, S) bool: the pixels each object covers


def render(world: World, scenes: list[Scene], rng: np.random.Generator) -> tuple[np.ndarray, Geometry]:
    """Images (N, 3, S, S) float32 in [0, 1] and the objects' geometry; deterministic given ``rng``."""
    n, size = len(scenes), world.size
    pix = np.arange(size) + 0.5
    yy, xx = np.meshgrid(pix, pix, indexing="ij")
    radii = rng.uniform(0.17, 0.21, size=(n, 2)) * size
    along = np.stack([np.full(n, 0.25), np.full(n, 0.75)], 1) * size + rng.uniform(-1, 1, (n, 2)) * size / 32
    across = 0.5 * size + rng.uniform(-1, 1, (n, 2)) * size / 8
    horizontal = np.array([s.arrangement == "h" for s in scenes])[:, None]
    cx, cy = np.where(horizontal, along, across), np.where(horizontal, across, along)
    background = rng.uniform(0.0, 0.15, size=(n, 1, 1, 1))
    images = np.broadcast_to(background, (n, 3, size, size)).copy()
    masks = np.zeros((n, 2, size, size), dtype=bool)
    jitter = rng.uniform(-0.05, 0.05, size=(n, 2, 3))
    for k in range(2):
        objs = [s.first if k == 0 else s.second for s in scenes]
        for shape in {o.shape for o in objs}:
            rows = np.array([i for i, o in enumerate(objs) if o.shape == shape])
            dx = xx[None] - cx[rows, k, None, None]
            dy = yy[None] - cy[rows, k, None, None]
            masks[rows, k] = shape_mask(shape, dx, dy, radii[rows, k, None, None])
        rgb = np.clip(np.array([COLOURS[o.colour] for o in objs]) + jitter[:, k], 0.0, 1.0)
        images = np.where(masks[:, k, None], rgb[:, :, None, None], images)
    if world.noise > 0:
        images = images + rng.normal(0.0, world.noise, size=images.shape)
    images = np.clip(images, 0.0, 1.0).astype(np.float32)
    return images, Geometry(np.stack([cx, cy], -1), radii, masks)
