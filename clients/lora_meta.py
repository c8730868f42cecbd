"""LoRA-ML on real data as a fedsim learner: retraining on binary digit or text tasks, few-shot LoRA on a new one.

Paper: Block, Srinivasan, Collins, Mokhtari, Shakkottai, "Provable Meta-Learning with Low-Rank
Adaptations", NeurIPS 2025, arXiv:2410.22264.  Code read: ``github.com/jacob-block/peft-ml``
``vision/run_cifar.py``, ``vision/train_utils.py``, ``vision/model.py``, ``vision/MLP.py``,
``vision/scripts/*.sh``.  The linear experiment is the centralised method ``peft_meta_linear``
(:mod:`central.peft_meta`).

**The authors' vision experiment.**  CIFAR-10 binary tasks with label = class mod 2: retrain on
0v1, 2v3, 4v5, 6v7 (T = 4), adapt to 8v9.  An MLP-Mixer whose every ``nn.Linear`` carries T
rank-1 adapters (``x Wᵀ + b + B_t A_t x``, B_t = 0 at start).  Retraining methods:

* ``lora-ml`` — each optimiser step accumulates the gradients of one batch of every task (adapter
  t active for task t) and takes one Adam step on base *and* adapters (lr 1e-4, wd 1e-5, cosine);
* ``standard`` — one model, Adam on the pooled data of the four tasks;
* ``reptile`` — per task: copy, 20 SGD steps (1e-2), then an outer update of the base.

Then ``lora_ft``: a fresh rank-1 adapter on every linear layer of the retrained base, base frozen,
Adam (5e-4) for 100 epochs on 8v9; the metric is test accuracy on 8v9 (last and best epoch).

**Here** (the ``lora_meta`` learner; what a round is):

* Data: the offline MNIST (``envs.datasets`` ``mnist``, 5,000 images; ``digits`` for tests); task
  = a digit pair with label = position in the pair (= digit mod 2 for the default pairs), each
  retraining task cut to the same number of training images (so example-weighted FedAvg weights
  every task equally); ``test_fraction`` of each pair held out for client-side evaluation.
* Model (:mod:`clients.lora_meta_model`): by default a small MLP-Mixer as the authors' (patches of
  7 × 7 pixels, width 32, one block, token MLP ×4, channel MLP ×0.5), or an MLP (``arch: mlp``),
  with a rank-k LoRA bank on every linear layer (the head too), as the authors' ``AdapterLinear``.
* Nodes hold tasks: node p gets tasks ``array_split(range(T), num_clients)[p]``, so
  ``num_clients: 1`` is the authors' centralised joint training (one node, all T tasks) and
  ``num_clients: T`` is **personalised FL with client = task**.  A round is ``local_steps`` steps;
  each step draws one batch of ``batch_size`` from every task the node holds.
* ``lora_ml``: the node trains base + its tasks' adapters (one Adam step per step on the mean loss
  over its tasks' batches, each through its own adapter); replies with the **base only**; its
  adapters stay in the node's ``ctx.state`` across rounds (FedAvg of the base with client-local
  adapters — FedPer/FedLoRA-style).
* ``retrain``: the same batches through the plain model, Adam; replies with the whole model
  (FedAvg of the whole model; centralised = one model on the pooled data).
* ``reptile``: for every task the node holds, ``local_steps`` SGD steps from the received model;
  the node replies ``θ + ε_r · mean_t(θ_t − θ)``.  Example-weighted FedAvg of those replies is
  exactly Reptile's outer step ``θ + ε_r · mean over all tasks (θ_t − θ)`` (equal task sizes), so
  the centralised and federated runs are the same algorithm — no server-side strategy is needed.
* Server-side evaluation every round (``evaluate_global``): for each of ``ft_repeats`` seeded draws
  of ``shots`` balanced labelled images of the new pair, a fresh rank-k LoRA is fitted on the
  received base, base frozen, ``ft_steps`` full-batch Adam steps (the same budget for every method
  and round); new-task test accuracy / loss after adaptation (``eval/new_task_acc``,
  ``eval/new_task_loss``), before it (``eval/new_task_acc_before``) and along the way
  (``eval/new_task_acc_step<s>``); the base alone on the retraining tasks' test images
  (``eval/train_tasks_acc``).

**Deliberate deviations and reconstructed pieces**

* MNIST and a small Mixer (width 32, 7 × 7 patches, no dropout) instead of CIFAR-10 and the
  authors' Mixer (width 512, 4 × 4 patches, dropout 0.1) — CPU budget and offline data; no
  augmentation, no AMP, no cosine schedule; Adam at 1e-3 (authors 1e-4 for 100 epochs) for
  rounds × local_steps steps; a fresh Adam every round (as FedAvg clients do), so the centralised
  run restarts Adam's moments each round, where the authors keep one Adam for the whole run.
* With ``arch: mlp`` the rank-1 adapter of the first layer alone is a linear classifier on the raw
  pixels, so a *random* base already adapts well on MNIST (measured: about as well as any retrained
  base); the Mixer's patch embedding is shared by all patches, so the base's features matter more.
* Few-shot adaptation (``shots`` images of the new pair, default 20) with full-batch Adam, where the
  authors fine-tune on the whole 8v9 training set for 100 epochs at 5e-4; lr 1e-2 × 100 steps
  moves the adapter by a similar total amount.  New-task accuracy is read at the end of the budget
  (the authors also report the best epoch, a test-set selection we do not copy); the authors keep
  the retraining epoch with the best validation accuracy on the retraining tasks, we report every
  round (``final_report``: final, mean over rounds, best round, last three, round 0 = untrained base).
* Our loss of a LoRA-ML step is the *mean* over the node's tasks (the authors sum the tasks'
  gradients before one Adam step; Adam is scale-invariant up to its ε).
* **Reptile is reconstructed**: the authors' ``reptile_update`` writes ``(θ_t − θ)/T`` into ``.grad``
  and calls Adam (lr 1e-5, 5 epochs), which moves the base *away* from the adapted weights and
  barely at all; we take Reptile's textbook step ``θ ← θ + ε (mean_t θ_t − θ)`` with ε annealed
  linearly from ``reptile_lr`` to 0 over the rounds (Nichol et al.), SGD inner steps at 1e-2.
  In FL this is a Reptile-style server step carried out by the clients' interpolated replies.
* Label = position in the pair (the authors' ``label % 2`` for their pairs; also defined for pairs
  such as [3, 8]).  Pairs may share digits (e.g. retrain on 0v8, 1v9, …, adapt to 8v9: a new task
  over seen digits); only the new pair itself must not be a retraining pair.
* The data and model settings are this learner's own ``client.params``: ``cfg.data`` and
  ``cfg.model`` are ignored (not logged; the image experiment file sets mnist/mlp, the text one stdlib_docs/minilm_lora).

**Differential privacy** (``--eps``, sample-level DP-SGD through :class:`privacy.facade.PrivateTrainer`;
every method):

* Unit of privacy: one training example (an image or a text with its 0/1 label) of one retraining
  task held by one node.  Each node's σ is calibrated for ``rounds × local_steps`` steps at Poisson
  rate ``1/⌈n/B⌉`` (``client.params.local_steps`` / ``batch_size`` are the plan's, not ``client.*``).
* ``lora_ml`` / ``retrain``: the DP data is ``(x, y, task slot)`` over the node's pooled task
  examples, so a step is one Poisson batch of expected size ``batch_size × tasks held`` drawn from the
  pool, each example through its own task's adapter (lora_ml) — **deviation**: not exactly one batch
  of ``batch_size`` per task as without DP (a batch's task mix is random).  The loss is the mean
  per-example cross-entropy; the adapters' per-sample gradients come from the grad sampler
  :func:`clients.lora_meta_model.register_opacus` (only the example's own slot is non-zero) and are
  clipped and noised with the base's.  The adapters kept in ``ctx.state`` are trained on private data
  by those DP steps only (post-processing of the noised gradients) and never leave the node.
* ``reptile``: each task's inner SGD is its own DP-SGD run on that task's examples; the tasks'
  examples are disjoint, so by parallel composition a round costs one run's ε (equal task sizes give
  every run the same plan), and the interpolated reply is post-processing.
* Not protected: the server-side few-shot adaptation (``evaluate_global``) fits on the *new* pair's
  shots, which no node holds (the server's own data, never a node's private examples) — it is
  evaluation, not training, and feeds nothing back to the nodes; ``eval/train_tasks_acc`` and
  client-side evaluation score the retraining tasks' held-out *test* splits; the train reply's
  ``loss`` / ``acc`` are diagnostics on private batches (released without DP under
  ``privacy.release=standard``, withheld under ``strict``).

**The MiniLM text variant** (``dataset: stdlib_docs``, ``arch: minilm``; ``experiments/peft_meta_text.yaml``):

* Data: the offline ``stdlib_docs`` text set (:mod:`envs.text`: standard-library docstring paragraphs
  labelled by module family, 10 families × 400), tokenised to ``max_len`` int64 MiniLM token ids
  (default 32); a task is a pair of family labels (label = position in the pair), by default
  retraining on families 0v1, 2v3, 4v5, 6v7 and adapting to 8v9 — the authors' CIFAR-10 split carried
  over to families.  The authors' language experiment (RoBERTa-base on ConvAI2, persona = task,
  T = 10, response selection) cannot be downloaded here; this is the offline stand-in.
* Model (:class:`clients.lora_meta_model.LoraMiniLM`): the pretrained MiniLM-L6 encoder with a rank-k
  LoRA bank on every attention query and value projection and on the linear head over the mean-pooled
  embedding.  **Deviation**: the base that retraining trains (and a round exchanges) is only those
  wrapped projections' weights and biases plus the head — the rest of the encoder stays frozen at the
  checkpoint — where the authors retrain the whole RoBERTa; the encoder's dropout is off; LoRA
  scale 1 (authors: rank 8, α 16, LoRA dropout 0.1, AdamW 5e-5).  Evaluation runs in chunks of 128.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord

from fedsim.contracts.learner import EvalResult, Learner, NodeContext, StateDict, TrainResult
from clients.lora_meta_model import LoraNet, build, register_opacus
from fedsim.config import ExperimentConfig
from fedsim.errors import ConfigError
from fedsim.registry import DATASETS, LEARNERS
from fedsim.seeding import derive_seed, numpy_rng
from privacy.facade import DP_STATE, PrivateTrainer
from privacy.plan import ClientPrivacyPlan

if TYPE_CHECKING:
    from fedsim.contracts.history import History

log = logging.getLogger("fedsim")

METHODS = ("lora_ml", "retrain", "reptile")
DATASET_NAMES = ("mnist", "digits", "stdlib_docs")
TEXT_DATASETS = ("stdlib_docs",)
ARCHS = ("mlp", "mixer", "minilm")
#: Examples per forward pass when scoring (bounds MiniLM's activation memory).
EVAL_CHUNK = 128
#: ``ctx.state`` record of a node's adapters (lora_ml).
STATE_KEY = "lora-meta-adapters"


@dataclass
class LoraMetaParams:
    """``client.params`` of the ``lora_meta`` learner."""

    method: str = "lora_ml"  # lora_ml | retrain | reptile
    dataset: str = "mnist"  # mnist | digits (offline arrays of envs.datasets) | stdlib_docs (text, arch minilm)
    max_len: int = 32  # stdlib_docs: token ids per example ([CLS]/[SEP] included)
    per_class: int = 400  # stdlib_docs: paragraphs per family (its balance cap; fewer = faster evaluation)
    train_pairs: list[list[int]] = field(default_factory=lambda: [[0, 1], [2, 3], [4, 5], [6, 7]])
    new_pair: list[int] = field(default_factory=lambda: [8, 9])
    test_fraction: float = 0.2  # of each retraining pair, held out (client-side and server-side evaluation)
    arch: str = "mixer"  # mixer (the authors' MLP-Mixer, small) | mlp | minilm (text: pretrained MiniLM-L6)
    hidden: list[int] = field(default_factory=lambda: [128, 128])  # mlp widths
    patch: int = 7  # mixer: patch size (28 / 7 = 4 x 4 patches; must divide the image size)
    dim: int = 32  # mixer: embedding width
    depth: int = 1  # mixer: blocks
    rank: int = 1  # k: per-task adapters and the new task's LoRA
    local_steps: int = 25  # steps per round; each step = one batch of every task the node holds
    batch_size: int = 64  # per task
    lr: float = 1.0e-3  # Adam (lora_ml, retrain)
    weight_decay: float = 1.0e-5
    reptile_inner_lr: float = 1.0e-2  # SGD inner steps
    reptile_lr: float = 1.0  # ε at round 1, annealed linearly to 0 over the rounds
    shots: int = 20  # labelled images of the new pair (half per class)
    ft_steps: int = 100  # fine-tuning budget: full-batch Adam steps of the fresh LoRA (every method)
    ft_lr: float = 1.0e-2
    ft_repeats: int = 3  # independent shot draws per evaluation (averaged)
    curve_points: list[int] = field(default_factory=lambda: [0, 10, 25, 50, 100])  # fine-tuning steps logged


def _train_step(opt: torch.optim.Optimizer, logits: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    """One optimiser step on the cross-entropy of ``logits``; returns (loss, correct predictions)."""
    loss = F.cross_entropy(logits, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item(), int((logits.argmax(1) == y).sum())


@dataclass
class Task:
    """One binary task: training and test inputs (images float32 N × 1 × H × W, or token ids int64
    N × max_len) with 0/1 labels."""

    pair: tuple[int, int]
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def make_tasks(x: np.ndarray, y: np.ndarray, pairs: list[list[int]], test_fraction: float, seed: int,
               balance: bool) -> list[Task]:
    """Binary tasks from labelled examples (images or token ids): seeded train/test split per pair;
    ``balance`` cuts every task's training set to the smallest one's size."""
    tasks = []
    for a, b in pairs:
        rows = np.flatnonzero((y == a) | (y == b))
        rows = rows[numpy_rng(seed, "lora-meta-split", a, b).permutation(len(rows))]
        n_test = max(1, int(round(test_fraction * len(rows))))
        test, train = rows[:n_test], rows[n_test:]
        label = lambda r: torch.from_numpy((y[r] == b).astype(np.int64))  # noqa: E731
        tasks.append(Task((a, b), torch.from_numpy(x[train]), label(train), torch.from_numpy(x[test]), label(test)))
    if balance:
        n = min(len(t.y_train) for t in tasks)
        for t in tasks:
            t.x_train, t.y_train = t.x_train[:n], t.y_train[:n]
    return tasks


def balanced_shots(y: torch.Tensor, shots: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``shots // 2`` examples of each class (seeded)."""
    out = [rng.choice(np.flatnonzero(y.numpy() == c), shots // 2, replace=False) for c in (0, 1)]
    return np.sort(np.concatenate(out))


def batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless shuffled index batches over n examples (a new permutation each pass)."""
    while True:
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n - batch_size + 1 if n >= batch_size else 1, batch_size):
            yield perm[start:start + batch_size]


@LEARNERS.register("lora_meta", params=LoraMetaParams,
                   summary="LoRA-ML meta-learning on binary digit / text tasks (lora_ml, retrain, reptile); "
                           "few-shot rank-k LoRA on a new task, personalised FL with client = task")
class LoraMetaLearner(Learner):
    """Retraining on T binary tasks (centralised or client = task), few-shot LoRA evaluation on a new one."""

    owns_environment = True  # the binary tasks (digits or text) and the LoRA network come from client.params
    supports_dp = True
    privacy_unit = ("one training example (image or text) of one retraining task held by one node; "
                    "the server's new-task shots and every test split are not protected")

    def __init__(self, cfg: ExperimentConfig, params: LoraMetaParams) -> None:
        super().__init__(cfg, params)
        self._tasks: list[Task] | None = None
        self._new: Task | None = None
        self._num_classes: int | None = None
        self._dp: dict[int, PrivateTrainer] = {}  # per node: its DP-SGD batch size depends on its task count

    # -- set-up ---------------------------------------------------------------------------------------
    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The dataset's inputs (float32 images, or int64 token ids for a text set) and labels."""
        p = self.params
        if self.is_text:
            from envs.text import StdlibDocsParams

            data = DATASETS.get(p.dataset)(StdlibDocsParams(max_len=p.max_len, per_class=p.per_class), self.cfg.seed)
            x = np.asarray(data.x, dtype=np.int64)
        else:
            data = DATASETS.get(p.dataset)(None, self.cfg.seed)
            x = np.asarray(data.x, dtype=np.float32)
        self._num_classes = int(data.num_classes)
        return x, np.asarray(data.y)

    def _load(self) -> None:
        p = self.params
        x, y = self._arrays()
        self._tasks = make_tasks(x, y, p.train_pairs, p.test_fraction, self.cfg.seed, balance=True)
        (self._new,) = make_tasks(x, y, [p.new_pair], 0.5, self.cfg.seed, balance=False)  # shot pool | test

    @property
    def is_text(self) -> bool:
        return self.params.dataset in TEXT_DATASETS

    @property
    def num_classes(self) -> int:
        """Classes of the underlying dataset (the labels pairs are drawn from)."""
        if self._num_classes is None and self.is_text:
            from envs.text import STDLIB_FAMILIES

            return len(STDLIB_FAMILIES)  # known without building the text set
        if self._num_classes is None:
            self._arrays()
        return self._num_classes  # type: ignore[return-value]

    @property
    def tasks(self) -> list[Task]:
        if self._tasks is None:
            self._load()
        return self._tasks  # type: ignore[return-value]

    @property
    def new_task(self) -> Task:
        if self._new is None:
            self._load()
        return self._new  # type: ignore[return-value]

    def node_tasks(self, partition_id: int) -> list[int]:
        """The retraining tasks node ``partition_id`` holds (all of them when centralised)."""
        split = np.array_split(np.arange(len(self.params.train_pairs)), self.cfg.num_clients)
        return [int(t) for t in split[partition_id]]

    @property
    def image_shape(self) -> tuple[int, ...]:
        """One example's shape: (C, H, W) for images, (max_len,) for token ids."""
        return tuple(int(d) for d in self.tasks[0].x_train.shape[1:])

    def model(self, slots: int) -> LoraNet:
        """A fresh model with ``slots`` adapter slots, base drawn from the run seed."""
        p = self.params
        return build(p.arch, self.image_shape, 2, p.rank, slots, derive_seed(self.cfg.seed, "lora-meta-init"),
                     list(p.hidden), p.patch, p.dim, p.depth)

    def adapter_seeds(self, task_ids: list[int]) -> list[int]:
        """Each task's adapter start depends on the task only (the same centralised and federated)."""
        return [derive_seed(self.cfg.seed, "lora-meta-adapter", t) for t in task_ids]

    # -- privacy (sample-level DP-SGD through privacy.facade) ------------------------------------------
    @property
    def sample_level_dp(self) -> bool:
        return self.cfg.privacy.enabled and self.cfg.privacy.level == "sample"

    def dp_trainer(self, partition_id: int) -> PrivateTrainer:
        """This node's DP-SGD: ``local_steps`` logical steps of expected batch ``batch_size`` × (tasks in
        one DP run: all the node's tasks for lora_ml / retrain, one for reptile's per-task runs)."""
        if partition_id not in self._dp:
            p = self.params
            per_run = 1 if p.method == "reptile" else len(self.node_tasks(partition_id))
            client = dataclasses.replace(self.cfg.client, batch_size=p.batch_size * per_run, local_steps=p.local_steps)
            self._dp[partition_id] = PrivateTrainer(dataclasses.replace(self.cfg, client=client))
        return self._dp[partition_id]

    def dp_examples(self, partition_id: int) -> int:
        """Rows of one DP run: the node's pooled task examples (reptile: one task's; tasks are equal-sized)."""
        sizes = [len(self.tasks[t].y_train) for t in self.node_tasks(partition_id)]
        return min(sizes) if self.params.method == "reptile" else sum(sizes)

    def privacy_plan(self, partition_id: int) -> ClientPrivacyPlan:
        return self.dp_trainer(partition_id).plan(partition_id, self.dp_examples(partition_id))

    def preflight(self) -> None:
        self._check_params()
        if self.sample_level_dp:
            for pid in range(self.cfg.num_clients):
                self.privacy_plan(pid)

    def _check_params(self) -> None:
        p, cfg = self.params, self.cfg
        if p.method not in METHODS:
            raise ConfigError(f"client.params.method must be one of {', '.join(METHODS)}, got {p.method!r}")
        if p.dataset not in DATASET_NAMES:
            raise ConfigError(f"client.params.dataset must be one of {', '.join(DATASET_NAMES)}, got {p.dataset!r}")
        if p.arch not in ARCHS:
            raise ConfigError(f"client.params.arch must be one of {', '.join(ARCHS)}, got {p.arch!r}")
        if self.is_text != (p.arch == "minilm"):
            raise ConfigError(f"client.params.arch={p.arch} does not fit dataset={p.dataset}: use arch minilm "
                              f"with a text dataset ({', '.join(TEXT_DATASETS)}) and mlp/mixer with images")
        if self.is_text and (not 2 <= p.max_len <= 512 or p.per_class < 2):
            raise ConfigError(f"client.params.max_len must be in [2, 512] (MiniLM's positions) and per_class >= 2, "
                              f"got {p.max_len} and {p.per_class}")
        pairs = [list(q) for q in p.train_pairs] + [list(p.new_pair)]
        flat = [d for q in pairs for d in q]
        k = self.num_classes
        if any(len(q) != 2 or q[0] == q[1] for q in pairs) or any(not 0 <= d < k for d in flat):
            raise ConfigError(f"client.params.train_pairs / new_pair must be pairs of two different class indices "
                              f"0-{k - 1} ({p.dataset} has {k} classes), got {pairs}")
        if any(set(p.new_pair) == set(q) for q in p.train_pairs):
            raise ConfigError(f"client.params.new_pair {list(p.new_pair)} is one of the train_pairs; "
                              f"the new task must be unseen")
        if not p.train_pairs:
            raise ConfigError("client.params.train_pairs is empty: list at least one retraining pair")
        if cfg.num_clients > len(p.train_pairs):
            raise ConfigError(f"num_clients={cfg.num_clients} but only {len(p.train_pairs)} retraining tasks; "
                              f"use num_clients=1 (centralised) up to {len(p.train_pairs)} (client = task)")
        if p.rank < 1 or p.local_steps < 1 or p.batch_size < 1 or p.ft_steps < 0 or p.ft_repeats < 1:
            raise ConfigError("client.params.rank, local_steps, batch_size, ft_repeats must be >= 1 and ft_steps >= 0")
        if min(p.lr, p.reptile_inner_lr, p.reptile_lr, p.ft_lr) <= 0 or p.weight_decay < 0:
            raise ConfigError("client.params.lr, reptile_inner_lr, reptile_lr, ft_lr must be > 0 (weight_decay >= 0)")
        if not 0.0 < p.test_fraction < 1.0:
            raise ConfigError(f"client.params.test_fraction must be in (0, 1), got {p.test_fraction}")
        if any(h < 1 for h in p.hidden) or p.dim < 1 or p.depth < 0:
            raise ConfigError("client.params.hidden widths and dim must be >= 1 and depth >= 0")
        if p.arch == "mixer" and (p.patch < 1 or self.image_shape[1] % p.patch):
            raise ConfigError(f"client.params.patch must divide the image size {self.image_shape[1]}, got {p.patch}")
        if any(not 0 <= s <= p.ft_steps for s in p.curve_points):
            raise ConfigError(f"client.params.curve_points must lie in [0, ft_steps={p.ft_steps}], "
                              f"got {p.curve_points}")
        pool = min(int((self.new_task.y_train == c).sum()) for c in (0, 1))
        if p.shots < 2 or p.shots % 2 or p.shots // 2 > pool:
            raise ConfigError(f"client.params.shots must be even, >= 2 and <= {2 * pool} (the new pair's shot pool), "
                              f"got {p.shots}")
        if cfg.strategy.fraction_train < 1.0:
            log.warning("lora_meta: fraction_train=%s, so unsampled task nodes skip their round",
                        cfg.strategy.fraction_train)

    def local_work(self, partition_id: int) -> float:
        return float(self.params.local_steps * len(self.node_tasks(partition_id)))

    # -- Learner API ------------------------------------------------------------------------------------
    def init_arrays(self) -> StateDict:
        return self.model(0).base_state()

    def _node_model(self, arrays: StateDict, ctx: NodeContext | None, task_ids: list[int]) -> LoraNet:
        """The received base with this node's adapters (kept in ctx.state, fresh the first time)."""
        model = self.model(len(task_ids))
        model.load_part(arrays)
        model.reset_adapters(self.adapter_seeds(task_ids))
        if ctx is not None and STATE_KEY in ctx.state:
            model.load_part(ctx.state[STATE_KEY].to_torch_state_dict())
        return model

    def train(self, arrays: StateDict, ctx: NodeContext) -> TrainResult:
        if self.sample_level_dp:
            return self._train_private(arrays, ctx)
        p = self.params
        task_ids = self.node_tasks(ctx.partition_id)
        gen = torch.Generator().manual_seed(ctx.seed("lora-meta-batches"))
        streams = [batches(len(self.tasks[t].y_train), p.batch_size, gen) for t in task_ids]
        if p.method == "reptile":
            out, loss, acc = self._reptile(arrays, task_ids, streams, ctx.server_round)
            adapter_norm = 0.0
        else:
            model = self._node_model(arrays, ctx, task_ids) if p.method == "lora_ml" else self._plain(arrays)
            loss, acc = self._joint(model, task_ids, streams, adapters=p.method == "lora_ml")
            out = model.base_state()
            adapter_norm = 0.0
            if p.method == "lora_ml":
                ctx.state[STATE_KEY] = ArrayRecord(model.adapter_state())
                adapter_norm = _adapter_norm(model)
        n = sum(len(self.tasks[t].y_train) for t in task_ids)
        return TrainResult(out, num_examples=n, metrics={"loss": loss, "acc": acc, "adapter_norm": adapter_norm})

    def _train_private(self, arrays: StateDict, ctx: NodeContext) -> TrainResult:
        """DP-SGD (:class:`privacy.facade.PrivateTrainer`): lora_ml / retrain take ``local_steps`` Poisson
        batches of the node's pooled task examples ``(x, y, task slot)``; reptile runs one DP-SGD per task."""
        register_opacus()
        p, pid = self.params, ctx.partition_id
        task_ids = self.node_tasks(pid)
        dp = self.dp_trainer(pid)
        tally = _Tally()
        if p.method == "reptile":
            out, ledger = self._reptile_private(arrays, task_ids, ctx, dp, tally)
            adapter_norm, loss = 0.0, tally.loss
        else:
            adapters = p.method == "lora_ml"
            model = self._node_model(arrays, ctx, task_ids) if adapters else self._plain(arrays)
            x = torch.cat([self.tasks[t].x_train for t in task_ids])
            y = torch.cat([self.tasks[t].y_train for t in task_ids])
            # slot 0 for the plain model too: Opacus records every forward input, so it must be a tensor
            slot = (torch.cat([torch.full((len(self.tasks[t].y_train),), s, dtype=torch.long)
                               for s, t in enumerate(task_ids)]) if adapters else torch.zeros(len(y), dtype=torch.long))
            params = model.base_parameters() + (model.adapter_parameters() if adapters else [])
            opt = torch.optim.Adam(params, lr=p.lr, weight_decay=p.weight_decay)
            result = dp.train_round(model, opt, (x, y, slot), ctx, num_examples=len(y), loss=tally.loss_fn)
            out, ledger, loss = model.base_state(), result.metrics, result.mean_loss
            adapter_norm = 0.0
            if adapters:  # trained by the DP steps only: post-processing of the noised gradients, and node-local
                ctx.state[STATE_KEY] = ArrayRecord(model.adapter_state())
                adapter_norm = _adapter_norm(model)
        n = sum(len(self.tasks[t].y_train) for t in task_ids)
        metrics = {"loss": loss, "acc": tally.acc, "adapter_norm": adapter_norm, **ledger}
        return TrainResult(out, num_examples=n, metrics=metrics)

    def _reptile_private(self, arrays: StateDict, task_ids: list[int], ctx: NodeContext, dp: PrivateTrainer,
                         tally: "_Tally") -> tuple[StateDict, dict[str, float]]:
        """Reptile under DP: each task's inner SGD is one DP-SGD run on that task's examples only.

        The tasks' examples are disjoint, so an example is in exactly one run: by parallel composition
        the node's round costs one run's ε (the same plan for every task: equal sizes), and the reply
        ``θ + ε_r · mean_t(θ_t − θ)`` is post-processing.  Every run starts from the same spent steps
        and the node's record advances by one run."""
        p = self.params
        deltas: list[StateDict] = []
        spent = ctx.state[DP_STATE] if DP_STATE in ctx.state else None
        ledger: dict[str, float] = {}
        after = None
        for t in task_ids:
            sub = _TaskContext(ctx.partition_id, ctx.num_partitions, ctx.server_round, ctx.root_seed,
                               config=ctx.config, task=t)
            if spent is not None:
                sub.state[DP_STATE] = spent
            model = self._plain(arrays)
            opt = torch.optim.SGD(model.base_parameters(), lr=p.reptile_inner_lr)
            x, y = self.tasks[t].x_train, self.tasks[t].y_train
            result = dp.train_round(model, opt, (x, y, torch.zeros(len(y), dtype=torch.long)), sub,
                                    num_examples=self.dp_examples(ctx.partition_id), loss=tally.loss_fn)
            tally.add_round(result.mean_loss)
            ledger, after = result.metrics, sub.state[DP_STATE]
            deltas.append({k: v - arrays[k] for k, v in model.base_state().items()})
        ctx.state[DP_STATE] = after
        eps = self.reptile_step_size(ctx.server_round)
        return {k: arrays[k] + eps * torch.stack([d[k] for d in deltas]).mean(0) for k in arrays}, ledger

    def _plain(self, arrays: StateDict) -> LoraNet:
        model = self.model(0)
        model.load_part(arrays)
        for q in model.adapter_parameters():  # the empty 0-slot banks: never trained (and no per-sample grads)
            q.requires_grad_(False)
        return model

    def _batch(self, task_ids: list[int], streams: list[Iterator[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """One batch of every task, concatenated, with each sample's adapter slot."""
        xs, ys, slots = [], [], []
        for slot, (t, stream) in enumerate(zip(task_ids, streams)):
            idx = next(stream)
            xs.append(self.tasks[t].x_train[idx])
            ys.append(self.tasks[t].y_train[idx])
            slots.append(torch.full((len(idx),), slot, dtype=torch.long))
        return torch.cat(xs), torch.cat(ys), torch.cat(slots)

    def _joint(self, model: LoraNet, task_ids: list[int], streams: list[Iterator[torch.Tensor]],
               adapters: bool) -> tuple[float, float]:
        """``local_steps`` Adam steps on the mean loss over one batch of every task (LoRA-ML: each
        task through its own adapter; retrain: the plain model on the pooled batch)."""
        p = self.params
        params = model.base_parameters() + (model.adapter_parameters() if adapters else [])
        opt = torch.optim.Adam(params, lr=p.lr, weight_decay=p.weight_decay)
        model.train()
        losses, correct, seen = [], 0, 0
        for _ in range(p.local_steps):
            x, y, slot = self._batch(task_ids, streams)
            loss, hits = _train_step(opt, model(x, slot if adapters else None), y)
            losses.append(loss)
            correct += hits
            seen += len(y)
        return float(np.mean(losses)), correct / seen

    def reptile_step_size(self, server_round: int) -> float:
        """ε annealed linearly from ``reptile_lr`` (round 1) towards 0 (after the last round)."""
        return self.params.reptile_lr * (1.0 - (server_round - 1) / self.cfg.rounds)

    def _reptile(self, arrays: StateDict, task_ids: list[int], streams: list[Iterator[torch.Tensor]],
                 server_round: int) -> tuple[StateDict, float, float]:
        """Inner SGD from the received model on each task; reply θ + ε · mean_t(θ_t − θ)."""
        p = self.params
        deltas: list[StateDict] = []
        losses, correct, seen = [], 0, 0
        for t, stream in zip(task_ids, streams):
            model = self._plain(arrays)
            opt = torch.optim.SGD(model.base_parameters(), lr=p.reptile_inner_lr)
            model.train()
            for _ in range(p.local_steps):
                idx = next(stream)
                x, y = self.tasks[t].x_train[idx], self.tasks[t].y_train[idx]
                loss, hits = _train_step(opt, model(x), y)
                losses.append(loss)
                correct += hits
                seen += len(y)
            deltas.append({k: v - arrays[k] for k, v in model.base_state().items()})
        eps = self.reptile_step_size(server_round)
        out = {k: arrays[k] + eps * torch.stack([d[k] for d in deltas]).mean(0) for k in arrays}
        return out, float(np.mean(losses)), correct / seen

    def evaluate(self, arrays: StateDict, ctx: NodeContext) -> EvalResult:
        """The node's tasks' test images, each through the node's own adapter (lora_ml) or the plain model."""
        task_ids = self.node_tasks(ctx.partition_id)
        adapters = self.params.method == "lora_ml"
        model = self._node_model(arrays, ctx, task_ids) if adapters else self._plain(arrays)
        x = torch.cat([self.tasks[t].x_test for t in task_ids])
        y = torch.cat([self.tasks[t].y_test for t in task_ids])
        slot = torch.cat([torch.full((len(self.tasks[t].y_test),), s, dtype=torch.long)
                          for s, t in enumerate(task_ids)])
        loss, acc = _scores(model, x, y, slot if adapters else None)
        return EvalResult(num_examples=len(y), metrics={"acc": acc, "loss": loss})

    def evaluate_global(self, arrays: StateDict) -> dict[str, float]:
        """Few-shot adaptation of a fresh rank-k LoRA on the new task (base frozen), averaged over draws;
        plus the base alone on the retraining tasks' test images."""
        p = self.params
        runs = [self.adapt(arrays, r) for r in range(p.ft_repeats)]
        out = {"new_task_acc": float(np.mean([r["acc"] for r in runs])),
               "new_task_loss": float(np.mean([r["loss"] for r in runs])),
               "new_task_acc_before": float(np.mean([r[f"acc_step{0}"] for r in runs]))}
        for s in p.curve_points:
            out[f"new_task_acc_step{s}"] = float(np.mean([r[f"acc_step{s}"] for r in runs]))
        x = torch.cat([t.x_test for t in self.tasks])
        y = torch.cat([t.y_test for t in self.tasks])
        out["train_tasks_acc"] = _scores(self._plain(arrays), x, y, None)[1]
        return out

    def shots(self, repeat: int) -> np.ndarray:
        """The ``repeat``-th seeded draw of balanced shots from the new pair's pool (same for every method)."""
        rng = numpy_rng(self.cfg.seed, "lora-meta-shots", repeat)
        return balanced_shots(self.new_task.y_train, self.params.shots, rng)

    def adapt(self, arrays: StateDict, repeat: int) -> dict[str, float]:
        """New-task test accuracy at every ``curve_points`` step and loss/accuracy at the end of the budget."""
        return self.fit_new_lora(arrays, repeat)[1]

    def fit_new_lora(self, arrays: StateDict, repeat: int) -> tuple[LoraNet, dict[str, float]]:
        """Fit a fresh rank-k LoRA (one slot, B = 0: starts as the base) on one draw of shots, base frozen
        (full-batch Adam, ``ft_steps`` steps); returns the model and its new-task test scores."""
        p, new = self.params, self.new_task
        idx = torch.from_numpy(self.shots(repeat))
        xs, ys = new.x_train[idx], new.y_train[idx]
        model = self.model(1)
        model.load_part(arrays)
        model.reset_adapters([derive_seed(self.cfg.seed, "lora-meta-ft", repeat)])
        for q in model.base_parameters():
            q.requires_grad_(False)
        opt = torch.optim.Adam(model.adapter_parameters(), lr=p.ft_lr)
        slot_s = torch.zeros(len(ys), dtype=torch.long)
        slot_t = torch.zeros(len(new.y_test), dtype=torch.long)
        out: dict[str, float] = {}
        checkpoints = set(p.curve_points) | {0}
        for step in range(p.ft_steps + 1):
            if step == p.ft_steps:
                break
            if step in checkpoints:
                out[f"acc_step{step}"] = _scores(model, new.x_test, new.y_test, slot_t)[1]
            model.train()
            loss = F.cross_entropy(model(xs, slot_s), ys)
            opt.zero_grad()
            loss.backward()
            opt.step()
        out["loss"], out["acc"] = _scores(model, new.x_test, new.y_test, slot_t)  # scored once at the end
        if p.ft_steps in checkpoints:
            out[f"acc_step{p.ft_steps}"] = out["acc"]
        return model, out

    def setup_summary(self) -> dict[str, Any]:
        m = self.model(len(self.node_tasks(0)))
        return {"lora_meta.tasks": len(self.tasks), "lora_meta.train_per_task": len(self.tasks[0].y_train),
                "lora_meta.new_pool": len(self.new_task.y_train), "lora_meta.new_test": len(self.new_task.y_test),
                "lora_meta.base_params": sum(q.numel() for q in m.base_parameters()),
                "lora_meta.adapter_params_per_task": sum(q[0].numel() for q in m.adapter_parameters())}

    # -- the run's report ---------------------------------------------------------------------------------
    def final_report(self, history: "History", out_dir: Path | None) -> tuple[dict[str, float], list[Path]]:
        rounds = [r for r in history.records if "eval/new_task_acc" in r.metrics]
        if not rounds:
            return {}, []
        accs = [r.metrics["eval/new_task_acc"] for r in rounds]
        last = rounds[-1].metrics
        metrics = {"new_task/acc_final": accs[-1], "new_task/acc_last3": float(np.mean(accs[-3:])),
                   "new_task/acc_mean_rounds": float(np.mean(accs[1:] or accs)),
                   "new_task/acc_round0": accs[0] if rounds[0].round == 0 else math.nan,  # the untrained base
                   "new_task/acc_best_round": float(max(accs[1:] or accs)),
                   "new_task/acc_before_final": last["eval/new_task_acc_before"],
                   "new_task/gain_final": accs[-1] - last["eval/new_task_acc_before"]}
        files: list[Path] = []
        if out_dir is not None:
            from fedsim.metrics.plots import save

            files.append(save(self._figure(rounds), out_dir / "lora_meta_new_task.png"))
        return {k: float(v) for k, v in metrics.items() if math.isfinite(v)}, files

    def _figure(self, rounds: list[Any]) -> Any:
        from fedsim.mpl import use_agg

        use_agg()
        import matplotlib.pyplot as plt

        p = self.params
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        x = [r.round for r in rounds]
        ax1.plot(x, [r.metrics["eval/new_task_acc"] for r in rounds], marker="o", ms=3, label="after few-shot LoRA")
        ax1.plot(x, [r.metrics["eval/new_task_acc_before"] for r in rounds], ls="--", label="base alone (before)")
        ax1.plot(x, [r.metrics["eval/train_tasks_acc"] for r in rounds], ls=":", label="base alone, retraining tasks")
        ax1.set_xlabel("round")
        ax1.set_ylabel("test accuracy")
        ax1.set_title(f"{p.method}: new task {p.new_pair[0]}v{p.new_pair[1]}, {p.shots} shots, {p.ft_steps} steps")
        ax1.legend()
        ax1.grid(alpha=0.3)
        pts = sorted(p.curve_points)
        for r in [rounds[i] for i in sorted({0, len(rounds) // 2, len(rounds) - 1})]:
            ax2.plot(pts, [r.metrics[f"eval/new_task_acc_step{s}"] for s in pts], marker="o", label=f"round {r.round}")
        ax2.set_xlabel("fine-tuning step (fresh rank-k LoRA, base frozen)")
        ax2.set_ylabel("new-task test accuracy")
        ax2.set_title(f"adaptation curves ({self.cfg.num_clients} node(s), seed {self.cfg.seed})")
        ax2.legend()
        ax2.grid(alpha=0.3)
        fig.tight_layout()
        return fig


class _Tally:
    """The DP loss ``loss(module, (x, y, slot))``: mean cross-entropy over the batch's examples, each
    through its task's adapter slot (a 0-slot model ignores it); counts accuracy and loss on the side
    (train diagnostics, released without DP like every learner's train loss: ``privacy/release.py``)."""

    def __init__(self) -> None:
        self.correct, self.seen, self.rounds = 0, 0, []  # type: ignore[var-annotated]

    def loss_fn(self, module: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y, slot = batch
        logits = module(x, slot)
        with torch.no_grad():
            self.correct += int((logits.argmax(1) == y).sum())
            self.seen += len(y)
        return F.cross_entropy(logits, y, reduction="sum") / max(len(y), 1)  # 0 on an empty Poisson batch

    def add_round(self, mean_loss: float) -> None:
        self.rounds.append(mean_loss)

    @property
    def loss(self) -> float:
        return float(np.mean(self.rounds)) if self.rounds else math.nan

    @property
    def acc(self) -> float:
        return self.correct / self.seen if self.seen else 0.0


@dataclass
class _TaskContext(NodeContext):
    """A node's context for one task's DP-SGD run (reptile): its own seeds and a scratch state."""

    task: int = 0

    def seed(self, stream: str) -> int:
        return derive_seed(self.root_seed, stream, self.server_round, self.partition_id, "task", self.task)


@torch.no_grad()
def _scores(model: LoraNet, x: torch.Tensor, y: torch.Tensor, slot: torch.Tensor | None) -> tuple[float, float]:
    """(mean cross-entropy, accuracy)."""
    model.eval()
    logits = torch.cat([model(x[i:i + EVAL_CHUNK], None if slot is None else slot[i:i + EVAL_CHUNK])
                        for i in range(0, len(x), EVAL_CHUNK)])
    return float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())


@torch.no_grad()
def _adapter_norm(model: LoraNet) -> float:
    """Mean over slots of the Frobenius norm of every layer's B_s A_s, summed over layers."""
    total = 0.0
    for layer in model.lora_layers():
        total += float(torch.linalg.matrix_norm(layer.lora_b @ layer.lora_a).mean())
    return total
