"""CKA-RL: Continual Knowledge Adaptation for RL (Hu, Lian, Wen, ..., Tan; NeurIPS 2025,
OpenReview ``QRlVickNdN``; code ``github.com/Fhujinwu/CKA-RL``).

Algorithm (paper Alg. 1, Eqs. 2-7; research notes ``continual.md`` §1): task 1 trains the actor
theta_base from scratch, then freezes it.  Every later task k trains only a knowledge vector v_k
(initialised to 0) and mixing logits beta_k over the pool V of earlier knowledge vectors,

    theta'_k = theta_base + sum_j softmax(beta_k)_j V_j + v_k,

where V starts as {0} (the "null knowledge" v_1 = theta_1 - theta_base).  After the task v_k joins V;
if then |V| > K_max, the most cosine-similar pair (Eq. 5-6) is replaced by its average (Eq. 7:
Adaptive Knowledge Merging), one merge per task.  The critic is re-initialised at every task; the
machinery applies to the actor only.

How it is stored (authors' ``FuseLinear``: the trainable ``weight`` starts at theta_base, so v_k =
weight - theta_base; the pool is a frozen stacked tensor): here the actor is one flat vector of D
parameters and the arrays are ``base`` (D), ``v`` (D), ``beta`` (P), ``scale`` (1), ``pool`` (P, D)
with ``pool_n`` rows in use, P = K_max + 1 (the pool's size right before a merge; N for an
unbounded pool), so every array keeps its shape for the whole run.  To evaluate an old task j the
method keeps, per task, its logits, its scale and which original vectors each pool slot held
(``task_beta``, ``task_scale``, ``task_refs``), and where every original vector lives now
(``slot_of``): theta_j = theta_base + sum_s alpha_{j,s} V[now(slot s)] + V[now(v_j)].  Before any
merge this is exactly the trained theta'_j; after merges it is what the merged pool can still
express -- the loss that merging costs (claim 3).  These records are O(N x P) numbers, the pool is
the memory that stays flat.

Where the authors' code and the paper differ, the paper is the default and the code an option
(:class:`CKARLConfig`):

* ``merge``: ``vector`` -- one cosine over the whole flattened v (paper Eq. 5); ``tensor`` -- the
  code's ``merge_vectors``, a separate most-similar pair per parameter tensor (so different layers
  may merge different pairs; slots are then tracked per tensor);
* ``encoder``: ``fused`` -- the whole actor is theta (paper); ``finetune`` -- the first layer is not
  fused but fine-tuned from task to task like FT-1 (the code's CNN encoder / Meta-World trunk), old
  tasks then use the current first layer; ``frozen`` -- the first layer stays theta_base's;
* ``beta_init``: ``randn`` -- beta ~ N(0, I) (paper Alg. 1); ``randn_scaled`` -- randn(K)/K (code);
* ``alpha_scale``: the code's softmax(beta * s) with a learnable scalar s (init 1); off = paper;
* PPO ``clip_coef`` 0.2 (paper Table 5) vs the code's 0.1 lives in :class:`algorithms.ckarl.ppo.PPOConfig`.

Other details follow the code: beta (and s) have their own Adam (``alpha_learning_rate`` 2.5e-4,
annealed with the main rate), the grad-norm clip covers them too, the merged vector goes to the end
of the pool.  Deviation: new vectors are appended at the end of the pool, the code prepends them
(beta is i.i.d., so only which random number meets which slot changes).  K_max default 3 for a
6-task stream (research notes; the paper uses 5 for Atari's 8-10 tasks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from algorithms.ckarl.agent import Layout, Method, StateDict
from fedsim.errors import ConfigError
from fedsim.seeding import torch_generator

__all__ = ["CKARL", "CKARLConfig", "fused_params", "merge_slots", "mixing_weights", "most_similar_pair"]

MERGES = ("vector", "tensor")
ENCODERS = ("fused", "finetune", "frozen")
BETA_INITS = ("randn", "randn_scaled")


@dataclass
class CKARLConfig:
    """CKA-RL's own settings (paper defaults; the authors' code choices as options)."""

    k_max: int = 3  # pool capacity K_max; 0 = unbounded (no merging)
    merge: str = "vector"  # vector (paper Eq. 5) | tensor (code: per parameter tensor)
    encoder: str = "fused"  # fused (paper) | finetune (code) | frozen
    beta_init: str = "randn"  # randn (paper: N(0, I)) | randn_scaled (code: randn(K)/K)
    alpha_scale: bool = False  # code: softmax(beta * s), s learnable; paper: softmax(beta)
    beta_lr: float = 2.5e-4  # Adam lr of beta (and s), annealed like the PPO lr (code alpha_learning_rate)

    def validate(self, where: str = "ckarl") -> None:
        if self.k_max < 0 or self.k_max == 1:
            raise ConfigError(f"{where}.k_max must be 0 (unbounded) or >= 2, got {self.k_max}")
        for name, value, allowed in (("merge", self.merge, MERGES), ("encoder", self.encoder, ENCODERS),
                                     ("beta_init", self.beta_init, BETA_INITS)):
            if value not in allowed:
                raise ConfigError(f"{where}.{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.beta_lr <= 0:
            raise ConfigError(f"{where}.beta_lr must be > 0, got {self.beta_lr}")


# --------------------------------------------------------------------------- the pure pieces


def mixing_weights(beta: Tensor, n: int, scale: Tensor | float = 1.0) -> Tensor:
    """alpha = softmax(beta[:n] * scale) over the n vectors in the pool."""
    return torch.softmax(beta[:n] * scale, dim=0)


def fused_params(base: Tensor, pool: Tensor, n: int, beta: Tensor, v: Tensor, scale: Tensor | float = 1.0) -> Tensor:
    """theta' = theta_base + sum_j softmax(beta)_j pool_j + v (paper Eq. 3)."""
    return base + mixing_weights(beta, n, scale) @ pool[:n] + v


def most_similar_pair(vectors: Tensor) -> tuple[int, int]:
    """(i, j), i < j, maximising cos(v_i, v_j) (Eq. 5-6); ties go to the first pair in row-major order,
    as the code's ``argmax`` over a matrix filled with -1 outside the upper triangle.  A zero vector
    has cosine 0 with everything."""
    n = vectors.shape[0]
    if n < 2:
        raise ValueError("merging needs at least two vectors")
    sims = torch.full((n, n), -1.0, dtype=torch.float64)
    unit = torch.nn.functional.normalize(vectors.double(), dim=1, eps=1e-12)
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    sims[upper] = (unit @ unit.t())[upper]
    flat = int(torch.argmax(sims))
    return divmod(flat, n)


def merge_slots(rows: Tensor, i: int, j: int) -> tuple[Tensor, list[int]]:
    """Replace rows i and j by their average, appended last (Eq. 7; the code's ``torch.cat`` order).

    Returns the n-1 new rows and ``new_slot[old_slot]`` for every old slot."""
    n = rows.shape[0]
    keep = [s for s in range(n) if s not in (i, j)]
    merged = torch.cat([rows[keep], ((rows[i] + rows[j]) / 2)[None]])
    new_slot = [0] * n
    for pos, s in enumerate(keep):
        new_slot[s] = pos
    new_slot[i] = new_slot[j] = n - 2
    return merged, new_slot


# --------------------------------------------------------------------------- the method


class CKARL(Method):
    """CKA-RL over a flat actor (see the module docstring)."""

    name = "ckarl"

    def __init__(self, layout: Layout, seed: int, reset_critic: bool = True, cfg: CKARLConfig | None = None) -> None:
        super().__init__(layout, seed, reset_critic)
        self.cfg = cfg or CKARLConfig()
        self.cfg.validate()
        n_tasks = layout.num_tasks
        self.capacity = min(self.cfg.k_max + 1, n_tasks) if self.cfg.k_max else n_tasks
        self.enc = self.actor_mlp.layer_slice(0)
        fused = [s for s in self.actor_mlp.slices() if self.cfg.encoder == "fused" or s.start >= self.enc.stop]
        self.groups = [slice(fused[0].start, fused[-1].stop)] if self.cfg.merge == "vector" else fused
        self.fused_numel = sum(s.stop - s.start for s in fused)

    @property
    def bounded(self) -> bool:
        return self.cfg.k_max > 0

    def _init(self) -> StateDict:
        D, P, N, G = self.actor_mlp.numel, self.capacity, self.layout.num_tasks, len(self.groups)
        slot_of = torch.full((G, N), -1.0)
        slot_of[:, 0] = 0.0  # original vector 0 = the null knowledge vector, in slot 0
        out = {"base": self.fresh_actor(0), "v": torch.zeros(D), "beta": torch.zeros(P), "scale": torch.ones(1),
               "pool": torch.zeros(P, D), "pool_n": torch.ones(1), "slot_of": slot_of,
               "task_refs": torch.full((N, G, P), -1.0), "task_beta": torch.zeros(N, P), "task_scale": torch.ones(N)}
        if self.cfg.encoder == "finetune":
            out["encoder"] = torch.zeros(self.enc.stop - self.enc.start)
        return out

    def pool_size(self, arrays: StateDict) -> int:
        return int(arrays["pool_n"].item())

    def begin_task(self, arrays: StateDict, k: int) -> StateDict:
        out = super().begin_task(arrays, k)
        if k == 0:
            return out
        n = self.pool_size(arrays)
        beta = torch.zeros_like(arrays["beta"])
        draw = torch.randn(n, generator=torch_generator(self.seed, "ckarl-beta", k))
        beta[:n] = draw / n if self.cfg.beta_init == "randn_scaled" else draw
        out.update(v=torch.zeros_like(arrays["v"]), beta=beta, scale=torch.ones(1))
        if self.cfg.encoder == "finetune" and k == 1:
            out["encoder"] = arrays["base"][self.enc].clone()
        return out

    def trainable_keys(self, k: int) -> list[str]:
        if k == 0:
            return ["base", "critic"]
        keys = ["v", "beta"] + (["scale"] if self.cfg.alpha_scale else [])
        return keys + (["encoder"] if self.cfg.encoder == "finetune" else []) + ["critic"]

    def mix_keys(self, k: int) -> list[str]:
        return ["beta", "scale"]

    def _with_encoder(self, arrays: StateDict, theta: Tensor) -> Tensor:
        if self.cfg.encoder == "fused":
            return theta
        enc = arrays["encoder"] if self.cfg.encoder == "finetune" else arrays["base"][self.enc]
        return torch.cat([enc, theta[self.enc.stop:]])

    def actor(self, arrays: StateDict, k: int) -> Tensor:
        if k == 0:
            return arrays["base"]
        scale = arrays["scale"] if self.cfg.alpha_scale else 1.0
        theta = fused_params(arrays["base"], arrays["pool"], self.pool_size(arrays), arrays["beta"], arrays["v"], scale)
        return self._with_encoder(arrays, theta)

    # -- the pool (server side) -----------------------------------------------------------------------
    def end_task(self, arrays: StateDict, k: int) -> StateDict:
        """Push v_k into the pool (remembering task k's logits and slots), then merge once if over K_max."""
        if k == 0:
            return arrays
        out = {key: t.clone() for key, t in arrays.items()}
        n = self.pool_size(arrays)
        slot_of, refs = out["slot_of"], out["task_refs"]
        for g in range(len(self.groups)):
            for s in range(n):
                refs[k, g, s] = float(torch.nonzero(slot_of[g] == s)[0, 0])  # a representative original vector
            slot_of[g, k] = float(n)
        out["task_beta"][k] = out["beta"]
        out["task_scale"][k] = out["scale"][0] if self.cfg.alpha_scale else 1.0
        out["pool"][n] = out["v"]
        n += 1
        if self.bounded and n > self.cfg.k_max:
            for g, sl in enumerate(self.groups):
                i, j = most_similar_pair(out["pool"][:n, sl])
                merged, new_slot = merge_slots(out["pool"][:n, sl], i, j)
                out["pool"][: n - 1, sl] = merged
                out["pool"][n - 1, sl] = 0.0
                live = slot_of[g] >= 0
                slot_of[g, live] = torch.tensor([float(new_slot[int(s)]) for s in slot_of[g, live]])
            n -= 1
        out["pool_n"] = torch.tensor([float(n)])
        return out

    def merge_history(self, arrays: StateDict) -> list[int]:
        """Which original vectors share a slot (group 0): slot index per original vector (-1: not yet)."""
        return [int(s) for s in arrays["slot_of"][0]]

    # -- evaluation --------------------------------------------------------------------------------------
    def task_actor(self, arrays: StateDict, j: int, done: int) -> Tensor:
        if done == 0:
            return arrays["base"]
        j = min(j, done - 1)
        if j == 0:
            return arrays["base"]
        pool, theta = arrays["pool"], arrays["base"].clone()
        refs = arrays["task_refs"][j]
        n_j = int((refs[0] >= 0).sum())
        alpha = mixing_weights(arrays["task_beta"][j], n_j, arrays["task_scale"][j])
        for g, sl in enumerate(self.groups):
            where = arrays["slot_of"][g]
            rows = torch.stack([pool[int(where[int(refs[g, s])]), sl] for s in range(n_j)])
            theta[sl] = theta[sl] + alpha @ rows + pool[int(where[j]), sl]
        return self._with_encoder(arrays, theta)

    def memory(self, arrays: StateDict, done: int) -> int:
        extra = self.enc.stop - self.enc.start if self.cfg.encoder == "finetune" else 0
        return self.actor_mlp.numel + self.pool_size(arrays) * self.fused_numel + extra
