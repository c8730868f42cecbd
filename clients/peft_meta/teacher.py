"""The ``tasks: teacher`` family of the ``lora_meta`` learner: binary tasks labelled by a shared teacher
network plus a task-specific rank-k change of one of its layers (LoRA-ML's generative model, nonlinear).

Paper: Block, Srinivasan, Collins, Mokhtari, Shakkottai, "Provable Meta-Learning with Low-Rank
Adaptations", arXiv:2410.22264.  Its data model (linear, ``linear/run.py``) is ``y = (A* + U_t U_tᵀ) x + ε``:
every task is a shared A* plus a task-specific rank-k term, and a new task is ``A* + U_new U_newᵀ``, so
a fresh rank-k LoRA on the right base is all a new task needs.  **Here** the same structure is lifted to
a nonlinear classifier on real inputs (issue #30: on digit pairs an untrained base adapts best, so that
benchmark cannot separate the methods):

* Inputs ``φ(x)``: the offline MNIST images (``envs.datasets`` ``mnist``, 5,000 images) projected on
  their top ``features`` principal components and whitened (unsupervised, fitted once on all images).
* Teacher: a :class:`clients.lora_meta_model.LoraMLP` of the student's own architecture
  (``φ → hidden … → 2``), its base drawn from the run seed: first-layer rows ~ N(0, I/d) in mirrored
  pairs with zero bias and equal outgoing weights (``relu(z) + relu(−z) = |z|``: no linear part for a
  linear probe), the head weight ×``HEAD_GAIN`` (confident teacher logits), the head bias set so that
  the shared teacher splits the images 50/50.  Task t (t < T retraining tasks, t = T the new one) adds
  a rank-k ``B_t A_t`` to **one layer** (``teacher_layer``: −1 = the head, the default of the
  experiment; 0 = the first layer), Gaussian factors rescaled to an RMS of ``teacher_scale`` × the
  layer weight's, keeping the mirror; every other adapter is zero.  A draw whose labels are not
  40-60 % positive is redrawn (seeded).  Label = the teacher's argmax.
* Every retraining task labels the same retraining images (its own seeded train/test split); the new
  task's images are disjoint from them: a shot pool, a validation split (hyper-parameter selection)
  and a test split.

So a student whose base is the teacher's base represents the new task exactly with a rank-k LoRA (the
ceiling, method ``oracle``), and an untrained base has to learn the shared weights from the shots (the
floor, method ``untrained``).

**Deliberate deviations.** The perturbation is asymmetric (``B_t A_t``, a LoRA) where the paper's is
``U_t U_tᵀ`` (its A* is square and symmetric; a layer weight out × in is not); labels are the argmax
of a ReLU network instead of a noisy linear response; the inputs are PCA features of MNIST, not
Gaussian; tasks are conditioned on balanced labels (the redraw).  The head is the default changed layer
because a first-layer change made a poor instrument: a fresh rank-k LoRA fitted on 100-200 shots of the
new task mostly *lowered* the accuracy of the teacher's own base (e.g. 0.85 → 0.71-0.79), while on the
head the fit from the right features is well posed.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from clients.lora_meta_model import LoraMLP, LoraNet, MultiLoraLinear, build
from clients.peft_meta.environment import EVAL_CHUNK, Task
from clients.peft_meta.params import LoraMetaParams
from fedsim.seeding import derive_seed, numpy_rng

#: Retraining images per run (the rest of the 5,000 are the new task's pool, validation and test).
NEW_POOL, NEW_VAL, NEW_TEST = 400, 200, 400
#: Gain on the teacher's head weight: the oracle base's logits are then confident (a margin of a few
#: units), so the first steps of a fresh LoRA do not flip the many near-boundary labels of a unit-gain head.
HEAD_GAIN = 5.0
#: Seeded redraws of a task's perturbation until its labels are balanced (see :func:`build_teacher`).
MAX_DRAWS = 1000


def pca_features(x: np.ndarray, dims: int) -> np.ndarray:
    """Whitened top-``dims`` principal components of the flattened images (float32, N × dims)."""
    flat = x.reshape(len(x), -1).astype(np.float64)
    flat = flat - flat.mean(0)
    _, s, vt = np.linalg.svd(flat, full_matrices=False)
    z = flat @ vt[:dims].T / (s[:dims] / math.sqrt(len(flat)))
    return z.astype(np.float32)


@torch.no_grad()
def teacher_logits(teacher: LoraNet, x: torch.Tensor, task: int | None) -> torch.Tensor:
    """Teacher logits on ``x`` through task ``task``'s perturbation (None: the shared teacher alone)."""
    teacher.eval()
    out = []
    for i in range(0, len(x), EVAL_CHUNK):
        chunk = x[i:i + EVAL_CHUNK]
        slot = None if task is None else torch.full((len(chunk),), task, dtype=torch.long)
        out.append(teacher(chunk, slot))
    return torch.cat(out) if out else torch.zeros(0, 2)


@torch.no_grad()
def balance_head(teacher: LoraNet, x: torch.Tensor) -> None:
    """Shift the head bias so that the shared teacher's logit margin has median 0 on ``x``."""
    margin = teacher_logits(teacher, x, None) @ torch.tensor([-1.0, 1.0])
    head = teacher.lora_layers()[-1]
    head.bias.add_(torch.tensor([0.5, -0.5]) * float(margin.median()))


def teacher_labels(teacher: LoraNet, x: torch.Tensor, task: int | None) -> torch.Tensor:
    """0/1 labels: the teacher's argmax through task ``task``'s perturbation."""
    return teacher_logits(teacher, x, task).argmax(1)


def build_teacher(params: LoraMetaParams, x: torch.Tensor, num_tasks: int, seed: int) -> LoraNet:
    """The teacher on inputs like ``x``: the student's MLP with ``num_tasks`` slots (T retraining tasks,
    then the new one); slot t's adapter in layer ``teacher_layer`` is ``B_t A_t``, every other adapter zero.

    Shared base: first-layer rows ~ N(0, I/d) in mirrored pairs (unit j and j + h/2 have opposite
    weights, zero bias, the same outgoing weights: ``relu(z) + relu(-z) = |z|``, so the labels have no
    linear part a linear probe could read), the rest ``nn.Linear``'s default; the head bias splits ``x``
    50/50 under the shared teacher.  Each task's ``(A_t, B_t)`` keeps the mirror (still rank k) and is
    redrawn (seeded) until its labels on ``x`` are within 40-60 % positive (balanced tasks without a
    per-task threshold, so the shared base plus the rank-k change is the *whole* task)."""
    p = params
    dims = x.shape[1]
    teacher = build("mlp", (dims,), 2, p.rank, num_tasks, derive_seed(seed, "lora-meta-teacher"),
                    list(p.hidden), p.patch, p.dim, p.depth)
    assert isinstance(teacher, LoraMLP)
    gen = torch.Generator().manual_seed(derive_seed(seed, "lora-meta-teacher-tasks"))
    first = teacher.layers[0]
    h, k = first.out_features, p.rank
    half = h // 2
    with torch.no_grad():
        w = torch.randn(h, dims, generator=gen) / math.sqrt(dims)  # unit-variance pre-activations
        w[half:2 * half] = -w[:half]
        first.weight.copy_(w)
        first.bias.zero_()
        if len(teacher.layers) > 1:
            nxt = teacher.layers[1]
            nxt.weight[:, half:2 * half] = nxt.weight[:, :half]
        teacher.layers[-1].weight.mul_(HEAD_GAIN)  # confident teacher logits (see HEAD_GAIN)
        for layer in teacher.layers:
            layer.lora_a.zero_()
            layer.lora_b.zero_()
    balance_head(teacher, x)
    layer = teacher.layers[p.teacher_layer]
    mirror_in = len(teacher.layers) == 2 and layer is teacher.layers[-1]  # the head reads mirrored units
    for t in range(num_tasks):
        for _ in range(MAX_DRAWS):
            b, a = _perturbation(layer, k, half, layer is first, mirror_in, p.teacher_scale, gen)
            with torch.no_grad():
                layer.lora_a[t].copy_(a)
                layer.lora_b[t].copy_(b)
            if 0.4 <= float(teacher_labels(teacher, x, t).float().mean()) <= 0.6:
                break
        else:
            raise ValueError(f"no balanced teacher task {t} in {MAX_DRAWS} draws; lower teacher_scale")
    return teacher


def _perturbation(layer: MultiLoraLinear, k: int, half: int, mirror_rows: bool, mirror_in: bool, scale: float,
                  gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank-k change ``B A`` of ``layer`` (B: out × k, A: k × in), Gaussian factors rescaled so that its
    entries' RMS is ``scale`` × the layer weight's; it keeps the mirror (first layer: B's mirrored rows
    negated; the head of one hidden layer: A's mirrored columns equal), so it stays rank k."""
    b = torch.randn(layer.out_features, k, generator=gen)
    a = torch.randn(k, layer.in_features, generator=gen)
    if mirror_rows:  # the first layer: mirrored units
        b[half:2 * half] = -b[:half]
    if mirror_in:
        a[:, half:2 * half] = a[:, :half]
    rms = float((b @ a).pow(2).mean().sqrt())
    target = scale * float(layer.weight.detach().pow(2).mean().sqrt())
    return b * (target / max(rms, 1e-12)), a


def make_teacher_tasks(x_images: np.ndarray, params: LoraMetaParams, seed: int
                       ) -> tuple[list[Task], Task, LoraNet]:
    """(retraining tasks, the new task, the teacher) from the images; deterministic in ``seed``.

    The images are permuted (seeded); the first ``NEW_POOL + NEW_VAL + NEW_TEST`` are the new task's
    shot pool, validation and test splits, the rest the retraining images, which every retraining task
    labels with its own teacher and splits train/test (``test_fraction``, per-task seeded split)."""
    p = params
    feats = torch.from_numpy(pca_features(x_images, p.features))
    order = torch.from_numpy(numpy_rng(seed, "lora-meta-teacher-images").permutation(len(feats)))
    feats = feats[order]
    n_new = NEW_POOL + NEW_VAL + NEW_TEST
    new_x, train_x = feats[:n_new], feats[n_new:]
    teacher = build_teacher(p, feats, p.num_tasks + 1, seed)
    tasks = []
    n_test = max(1, int(round(p.test_fraction * len(train_x))))
    for t in range(p.num_tasks):
        perm = torch.from_numpy(numpy_rng(seed, "lora-meta-teacher-split", t).permutation(len(train_x)))
        xt = train_x[perm]
        y = teacher_labels(teacher, xt, t)
        tasks.append(Task((t, t), xt[n_test:], y[n_test:], xt[:n_test], y[:n_test]))
    y_new = teacher_labels(teacher, new_x, p.num_tasks)
    pool, val = slice(0, NEW_POOL), slice(NEW_POOL, NEW_POOL + NEW_VAL)
    test = slice(NEW_POOL + NEW_VAL, n_new)
    new = Task((p.num_tasks, p.num_tasks), new_x[pool], y_new[pool], new_x[test], y_new[test],
               new_x[val], y_new[val])
    return tasks, new, teacher


def teacher_base(teacher: LoraNet) -> dict[str, torch.Tensor]:
    """The teacher's shared base (no adapters): the oracle's starting point (method ``oracle``)."""
    return teacher.base_state()
