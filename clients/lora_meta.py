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

**Two reference methods** (no retraining, every round replies the received base unchanged):
``untrained`` — the run seed's base (the floor: round 0 as a configuration a claim check can compare
against); ``oracle`` — only with ``tasks: teacher``, the teacher's own shared base (the ceiling).

**The teacher task family** (``tasks: teacher``, :mod:`clients.peft_meta.teacher`,
``experiments/peft_meta_teacher.yaml``): on digit pairs a random base plus a rank-1 LoRA is already a
good few-shot classifier (the pairs are nearly linearly separable), so nothing shared is *needed* and
the benchmark cannot separate the methods (issue #30).  The teacher family makes the shared structure
necessary: inputs are whitened PCA features of the MNIST images, task t's labels come from one random
teacher network of the student's architecture plus a task-specific rank-k change of one layer
(``teacher_layer``, the head by default), i.e. the paper's ``A* + U_t U_tᵀ`` lifted to a nonlinear
classifier; the new task is one more such change, so the teacher's base plus a rank-k LoRA represents
it exactly.  The new task has a validation split (``val/new_task_acc``, what a claim check tunes on).

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
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from clients.lora_meta_model import LoraNet, register_opacus
from clients.peft_meta.adaptation import evaluate_new_task, fit_new_lora, shot_indices
from clients.peft_meta.dp import Tally
from clients.peft_meta.environment import (  # noqa: F401  (re-exported: the learner's public names)
    EVAL_CHUNK,
    STATE_KEY,
    Task,
    TaskEnvironment,
    balanced_shots,
    batches,
    make_tasks,
    scores,
)
from clients.peft_meta.methods import StepResult, TrainingMethod, build_method, reptile_step_size
from clients.peft_meta.params import (  # noqa: F401  (re-exported)
    ARCHS,
    DATASET_NAMES,
    METHODS,
    TEXT_DATASETS,
    LoraMetaParams,
    check_params,
)
from clients.peft_meta.report import final_report
from fedsim.config import ExperimentConfig
from fedsim.contracts.learner import EvalResult, Learner, NodeContext, StateDict, TrainResult
from fedsim.registry import LEARNERS
from privacy.facade import PrivateTrainer
from privacy.plan import ClientPrivacyPlan

if TYPE_CHECKING:
    from fedsim.contracts.history import History


@LEARNERS.register("lora_meta", params=LoraMetaParams,
                   summary="LoRA-ML meta-learning on binary digit / text / teacher tasks (lora_ml, retrain, reptile); "
                           "few-shot rank-k LoRA on a new task, personalised FL with client = task")
class LoraMetaLearner(Learner):
    """Retraining on T binary tasks (centralised or client = task), few-shot LoRA evaluation on a new one.

    Composes the parts of :mod:`clients.peft_meta`: the tasks and networks (``environment``), the
    retraining method (``methods``), the few-shot evaluation (``adaptation``) and the report."""

    owns_environment = True  # the binary tasks (digits or text) and the LoRA network come from client.params
    supports_dp = True
    privacy_unit = ("one training example (image or text) of one retraining task held by one node; "
                    "the server's new-task shots and every test split are not protected")

    def __init__(self, cfg: ExperimentConfig, params: LoraMetaParams) -> None:
        super().__init__(cfg, params)
        self.env = TaskEnvironment(cfg, params)
        self._dp: dict[int, PrivateTrainer] = {}  # per node: its DP-SGD batch size depends on its task count

    @cached_property
    def method(self) -> TrainingMethod:
        """The plug-in of ``client.params.method`` (built on first use, after validation)."""
        return build_method(self.env)

    # -- the environment ------------------------------------------------------------------------------
    @property
    def is_text(self) -> bool:
        return self.env.is_text

    @property
    def num_classes(self) -> int:
        """Classes of the underlying dataset (the labels pairs are drawn from)."""
        return self.env.num_classes

    @property
    def tasks(self) -> list[Task]:
        return self.env.tasks

    @property
    def new_task(self) -> Task:
        return self.env.new_task

    @property
    def image_shape(self) -> tuple[int, ...]:
        """One example's shape: (C, H, W) for images, (max_len,) for token ids."""
        return self.env.image_shape

    def node_tasks(self, partition_id: int) -> list[int]:
        """The retraining tasks node ``partition_id`` holds (all of them when centralised)."""
        return self.env.node_tasks(partition_id)

    def model(self, slots: int) -> LoraNet:
        """A fresh model with ``slots`` adapter slots, base drawn from the run seed."""
        return self.env.model(slots)

    def adapter_seeds(self, task_ids: list[int]) -> list[int]:
        """Each task's adapter start depends on the task only (the same centralised and federated)."""
        return self.env.adapter_seeds(task_ids)

    def _node_model(self, arrays: StateDict, ctx: NodeContext | None, task_ids: list[int]) -> LoraNet:
        """The received base with this node's adapters (kept in ctx.state, fresh the first time)."""
        return self.env.node_model(arrays, ctx, task_ids)

    # -- privacy (sample-level DP-SGD through privacy.facade) ------------------------------------------
    @property
    def sample_level_dp(self) -> bool:
        return self.cfg.privacy.enabled and self.cfg.privacy.level == "sample"

    def dp_trainer(self, partition_id: int) -> PrivateTrainer:
        """This node's DP-SGD: ``local_steps`` logical steps of expected batch ``batch_size`` × (tasks in
        one DP run: all the node's tasks for lora_ml / retrain, one for reptile's per-task runs)."""
        if partition_id not in self._dp:
            p = self.params
            per_run = self.method.dp_tasks_per_run(self.node_tasks(partition_id))
            client = dataclasses.replace(self.cfg.client, batch_size=p.batch_size * per_run, local_steps=p.local_steps)
            self._dp[partition_id] = PrivateTrainer(dataclasses.replace(self.cfg, client=client))
        return self._dp[partition_id]

    def dp_examples(self, partition_id: int) -> int:
        """Rows of one DP run: the node's pooled task examples (reptile: one task's; tasks are equal-sized)."""
        return self.method.dp_examples(self.node_tasks(partition_id))

    def privacy_plan(self, partition_id: int) -> ClientPrivacyPlan:
        return self.dp_trainer(partition_id).plan(partition_id, self.dp_examples(partition_id))

    def preflight(self) -> None:
        check_params(self.params, self.cfg, self.env)
        if self.sample_level_dp:
            for pid in range(self.cfg.num_clients):
                self.privacy_plan(pid)

    def local_work(self, partition_id: int) -> float:
        return float(self.params.local_steps * len(self.node_tasks(partition_id)))

    # -- Learner API ------------------------------------------------------------------------------------
    def init_arrays(self) -> StateDict:
        """The round-0 base (the run seed's draw; the teacher's shared base for ``oracle``)."""
        return self.method.init_arrays()

    def train(self, arrays: StateDict, ctx: NodeContext) -> TrainResult:
        task_ids = self.node_tasks(ctx.partition_id)
        if self.sample_level_dp:
            # DP-SGD (privacy.facade.PrivateTrainer): lora_ml / retrain take ``local_steps`` Poisson batches
            # of the node's pooled task examples ``(x, y, task slot)``; reptile runs one DP-SGD per task
            register_opacus()
            step = self.method.train_private(arrays, ctx, task_ids, self.dp_trainer(ctx.partition_id), Tally())
        else:
            gen = torch.Generator().manual_seed(ctx.seed("lora-meta-batches"))
            streams = [batches(len(self.tasks[t].y_train), self.params.batch_size, gen) for t in task_ids]
            step = self.method.train(arrays, ctx, task_ids, streams)
        return self._reply(step, task_ids)

    def _reply(self, step: StepResult, task_ids: list[int]) -> TrainResult:
        metrics = {"loss": step.loss, "acc": step.acc, "adapter_norm": step.adapter_norm, **step.ledger}
        return TrainResult(step.arrays, num_examples=self.env.train_examples(task_ids), metrics=metrics)

    def reptile_step_size(self, server_round: int) -> float:
        """ε annealed linearly from ``reptile_lr`` (round 1) towards 0 (after the last round)."""
        return reptile_step_size(self.params, self.cfg.rounds, server_round)

    def evaluate(self, arrays: StateDict, ctx: NodeContext) -> EvalResult:
        """The node's tasks' test images, each through the node's own adapter (lora_ml) or the plain model."""
        task_ids = self.node_tasks(ctx.partition_id)
        model = self.method.node_model(arrays, ctx, task_ids)
        x, y, slot = self.env.pooled(task_ids, "test")
        loss, acc = scores(model, x, y, slot if self.method.adapters else None)
        return EvalResult(num_examples=len(y), metrics={"acc": acc, "loss": loss})

    def evaluate_global(self, arrays: StateDict) -> dict[str, float]:
        """Few-shot adaptation of a fresh rank-k LoRA on the new task (base frozen), averaged over draws;
        plus the base alone on the retraining tasks' test images."""
        return evaluate_new_task(self.env, arrays)

    def shots(self, repeat: int) -> np.ndarray:
        """The ``repeat``-th seeded draw of balanced shots from the new pair's pool (same for every method)."""
        return shot_indices(self.env, repeat)

    def adapt(self, arrays: StateDict, repeat: int) -> dict[str, float]:
        """New-task test accuracy at every ``curve_points`` step and loss/accuracy at the end of the budget."""
        return self.fit_new_lora(arrays, repeat)[1]

    def fit_new_lora(self, arrays: StateDict, repeat: int) -> tuple[LoraNet, dict[str, float]]:
        """Fit a fresh rank-k LoRA on one draw of shots, base frozen; returns the model and its scores."""
        return fit_new_lora(self.env, arrays, repeat)

    def setup_summary(self) -> dict[str, Any]:
        m = self.model(len(self.node_tasks(0)))
        return {"lora_meta.tasks": len(self.tasks), "lora_meta.train_per_task": len(self.tasks[0].y_train),
                "lora_meta.new_pool": len(self.new_task.y_train), "lora_meta.new_test": len(self.new_task.y_test),
                "lora_meta.base_params": sum(q.numel() for q in m.base_parameters()),
                "lora_meta.adapter_params_per_task": sum(q[0].numel() for q in m.adapter_parameters())}

    def final_report(self, history: "History", out_dir: Path | None) -> tuple[dict[str, float], list[Path]]:
        return final_report(history, out_dir, self.params, self.cfg)
