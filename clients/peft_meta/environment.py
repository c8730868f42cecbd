"""The ``lora_meta`` learner's environment: binary tasks from a labelled data set, the nodes' share of
them, the LoRA network (base drawn from the run seed, adapters from each task's seed) and scoring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from clients.lora_meta_model import LoraNet, build
from clients.peft_meta.params import TEXT_DATASETS, LoraMetaParams
from fedsim.config import ExperimentConfig
from fedsim.contracts.learner import NodeContext, StateDict
from fedsim.registry import DATASETS
from fedsim.seeding import derive_seed, numpy_rng

#: Examples per forward pass when scoring (bounds MiniLM's activation memory).
EVAL_CHUNK = 128
#: ``ctx.state`` record of a node's adapters (lora_ml).
STATE_KEY = "lora-meta-adapters"


@dataclass
class Task:
    """One binary task: training and test inputs (images float32 N × 1 × H × W, token ids int64
    N × max_len, or teacher features float32 N × d) with 0/1 labels; the teacher family's new task
    also has a validation split (``x_val`` / ``y_val``, hyper-parameter selection only)."""

    pair: tuple[int, int]  # the digit / family pair; (t, t) for teacher task t
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None


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


@torch.no_grad()
def scores(model: LoraNet, x: torch.Tensor, y: torch.Tensor, slot: torch.Tensor | None) -> tuple[float, float]:
    """(mean cross-entropy, accuracy)."""
    model.eval()
    logits = torch.cat([model(x[i:i + EVAL_CHUNK], None if slot is None else slot[i:i + EVAL_CHUNK])
                        for i in range(0, len(x), EVAL_CHUNK)])
    return float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())


@torch.no_grad()
def adapter_norm(model: LoraNet) -> float:
    """Mean over slots of the Frobenius norm of every layer's B_s A_s, summed over layers."""
    total = 0.0
    for layer in model.lora_layers():
        total += float(torch.linalg.matrix_norm(layer.lora_b @ layer.lora_a).mean())
    return total


class TaskEnvironment:
    """The run's retraining tasks and new task (built lazily from ``client.params``), which node holds
    which tasks, and fresh networks on them."""

    def __init__(self, cfg: ExperimentConfig, params: LoraMetaParams) -> None:
        self.cfg, self.params = cfg, params
        self._tasks: list[Task] | None = None
        self._new: Task | None = None
        self._num_classes: int | None = None
        self._teacher: LoraNet | None = None

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
        if self.is_teacher:
            from clients.peft_meta.teacher import make_teacher_tasks

            self._tasks, self._new, self._teacher = make_teacher_tasks(x, p, self.cfg.seed)
            return
        self._tasks = make_tasks(x, y, p.train_pairs, p.test_fraction, self.cfg.seed, balance=True)
        (self._new,) = make_tasks(x, y, [p.new_pair], 0.5, self.cfg.seed, balance=False)  # shot pool | test

    @property
    def is_text(self) -> bool:
        return self.params.dataset in TEXT_DATASETS

    @property
    def is_teacher(self) -> bool:
        """The ``tasks: teacher`` family (:mod:`clients.peft_meta.teacher`) instead of label pairs."""
        return self.params.tasks == "teacher"

    @property
    def num_train_tasks(self) -> int:
        """T: retraining tasks (``num_tasks`` teachers, or one per ``train_pairs`` entry)."""
        return self.params.num_tasks if self.is_teacher else len(self.params.train_pairs)

    @property
    def teacher(self) -> LoraNet:
        """The teacher network of the ``teacher`` family (slot t = task t, slot T = the new task)."""
        if not self.is_teacher:
            raise ValueError("only the teacher task family has a teacher")
        if self._teacher is None:
            self._load()
        return self._teacher  # type: ignore[return-value]

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
        split = np.array_split(np.arange(self.num_train_tasks), self.cfg.num_clients)
        return [int(t) for t in split[partition_id]]

    def train_examples(self, task_ids: list[int]) -> int:
        """Training examples of the given tasks together."""
        return sum(len(self.tasks[t].y_train) for t in task_ids)

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

    def node_model(self, arrays: StateDict, ctx: NodeContext | None, task_ids: list[int]) -> LoraNet:
        """The received base with this node's adapters (kept in ctx.state, fresh the first time)."""
        model = self.model(len(task_ids))
        model.load_part(arrays)
        model.reset_adapters(self.adapter_seeds(task_ids))
        if ctx is not None and STATE_KEY in ctx.state:
            model.load_part(ctx.state[STATE_KEY].to_torch_state_dict())
        return model

    def plain(self, arrays: StateDict) -> LoraNet:
        """The received base without adapter slots."""
        model = self.model(0)
        model.load_part(arrays)
        for q in model.adapter_parameters():  # the empty 0-slot banks: never trained (and no per-sample grads)
            q.requires_grad_(False)
        return model

    def pooled(self, task_ids: list[int], split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tasks' ``split`` ("train" or "test") examples together, with each example's adapter slot."""
        ys = [getattr(self.tasks[t], f"y_{split}") for t in task_ids]
        x = torch.cat([getattr(self.tasks[t], f"x_{split}") for t in task_ids])
        slot = torch.cat([torch.full((len(y),), s, dtype=torch.long) for s, y in enumerate(ys)])
        return x, torch.cat(ys), slot

    def batch(self, task_ids: list[int], streams: list[Iterator[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """One batch of every task, concatenated, with each sample's adapter slot."""
        xs, ys, slots = [], [], []
        for slot, (t, stream) in enumerate(zip(task_ids, streams)):
            idx = next(stream)
            xs.append(self.tasks[t].x_train[idx])
            ys.append(self.tasks[t].y_train[idx])
            slots.append(torch.full((len(idx),), slot, dtype=torch.long))
        return torch.cat(xs), torch.cat(ys), torch.cat(slots)
