"""Hard negatives from known slots: CLIC's between-sentence swap, NegCLIP's within-sentence swap, and the
five SugarCrepe++-style negative types of the evaluation.

The authors pick words of the same spaCy part of speech; here the slot types play that role
(``colour``: c1/c2, ``shape``: s1/s2, ``relation``: rel), so no parser is needed.
"""

from __future__ import annotations

import numpy as np

from central.clic.world import ALL_RELATIONS, SLOT_TYPE, Sentence

SLOT_TYPES = ("colour", "shape", "relation")
EVAL_TYPES = ("replace_att", "replace_obj", "replace_rel", "swap_att", "swap_obj")


def _words_of_type(s: Sentence, kind: str) -> set[str]:
    return {w for slot, w in s.chunks if slot is not None and SLOT_TYPE[slot] == kind}


def _substitute(s: Sentence, kind: str, old: str, new: str) -> Sentence:
    """Every chunk of slot type ``kind`` reading ``old`` now reads ``new`` (the authors' swap replaces
    every occurrence of the word)."""
    return Sentence(tuple((slot, new if slot is not None and SLOT_TYPE[slot] == kind and w == old else w)
                          for slot, w in s.chunks))


def swappable_types(a: Sentence, b: Sentence) -> list[str]:
    """Slot types with a word in ``a`` and a different word in ``b`` after dropping the words they share
    (the authors' ``same_type_words``: common words are removed from both sides first)."""
    out = []
    for kind in SLOT_TYPES:
        wa, wb = _words_of_type(a, kind), _words_of_type(b, kind)
        common = wa & wb
        if wa - common and wb - common:
            out.append(kind)
    return out


def swap_between(a: Sentence, b: Sentence, rng: np.random.Generator) -> tuple[Sentence, Sentence, str] | None:
    """CLIC's hard negative parts: a word of one slot type is swapped between the two sentences
    (``a``'s word becomes ``b``'s and vice versa); None when no type can be swapped."""
    kinds = swappable_types(a, b)
    if not kinds:
        return None
    kind = kinds[int(rng.integers(len(kinds)))]
    wa, wb = _words_of_type(a, kind), _words_of_type(b, kind)
    common = wa & wb
    w1 = sorted(wa - common)[int(rng.integers(len(wa - common)))]
    w2 = sorted(wb - common)[int(rng.integers(len(wb - common)))]
    return _substitute(a, kind, w1, w2), _substitute(b, kind, w2, w1), kind


def swap_within(s: Sentence, rng: np.random.Generator) -> tuple[Sentence, str]:
    """NegCLIP's single-sentence negative (the authors' ``get_hard_neg_single_sentence``): two different
    words of one slot type swap places (colour or shape; a sentence has one relation)."""
    kinds = [k for k in SLOT_TYPES if len(_words_of_type(s, k)) > 1]
    kind = kinds[int(rng.integers(len(kinds)))]
    first, second = ("c1", "c2") if kind == "colour" else ("s1", "s2")
    return s.with_slots(**{first: s.slot(second), second: s.slot(first)}), kind


def eval_negative(s: Sentence, kind: str, colours: tuple[str, ...], shapes: tuple[str, ...],
                  rng: np.random.Generator) -> Sentence:
    """A SugarCrepe++-style negative of ``s``: replace an attribute / object / relation by one the
    sentence does not use, or swap the two attributes / objects."""
    if kind == "swap_att":
        return s.with_slots(c1=s.slot("c2"), c2=s.slot("c1"))
    if kind == "swap_obj":
        return s.with_slots(s1=s.slot("s2"), s2=s.slot("s1"))
    if kind == "replace_rel":
        options = [r for r in ALL_RELATIONS if r != s.slot("rel")]
        return s.with_slots(rel=options[int(rng.integers(len(options)))])
    slots, pool = (("c1", "c2"), colours) if kind == "replace_att" else (("s1", "s2"), shapes)
    if kind not in ("replace_att", "replace_obj"):
        raise ValueError(f"unknown negative type {kind!r}")
    slot = slots[int(rng.integers(2))]
    used = {s.slot(n) for n in slots}
    options = [w for w in pool if w not in used]
    return s.with_slots(**{slot: options[int(rng.integers(len(options)))]})
