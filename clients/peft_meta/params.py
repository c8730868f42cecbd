"""``client.params`` of the ``lora_meta`` learner, the names they may take, and their validation."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fedsim.config import ExperimentConfig
from fedsim.errors import ConfigError

if TYPE_CHECKING:
    from clients.peft_meta.environment import TaskEnvironment

log = logging.getLogger("fedsim")

METHODS = ("lora_ml", "retrain", "reptile", "untrained", "oracle")  # the last two: floor and ceiling
TASK_FAMILIES = ("pairs", "teacher")
DATASET_NAMES = ("mnist", "digits", "stdlib_docs")
TEXT_DATASETS = ("stdlib_docs",)
ARCHS = ("mlp", "mixer", "minilm")


@dataclass
class LoraMetaParams:
    """``client.params`` of the ``lora_meta`` learner."""

    method: str = "lora_ml"  # lora_ml | retrain | reptile | untrained (no retraining: floor) | oracle (teacher base)
    tasks: str = "pairs"  # pairs (label pairs of dataset) | teacher (clients.peft_meta.teacher: teacher + rank-k)
    num_tasks: int = 4  # teacher: T retraining tasks
    features: int = 16  # teacher: whitened PCA components of the MNIST images (the inputs)
    teacher_scale: float = 1.0  # teacher: RMS of a task's B_t A_t / RMS of the layer's shared weight
    teacher_layer: int = 0  # teacher: the linear layer the task's rank-k change is in (0 = first, -1 = head)
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


def check_params(p: LoraMetaParams, cfg: ExperimentConfig, env: "TaskEnvironment") -> None:
    """Raise :class:`ConfigError` on settings the learner cannot run (``env`` supplies the data's shape)."""
    if p.method not in METHODS:
        raise ConfigError(f"client.params.method must be one of {', '.join(METHODS)}, got {p.method!r}")
    if p.dataset not in DATASET_NAMES:
        raise ConfigError(f"client.params.dataset must be one of {', '.join(DATASET_NAMES)}, got {p.dataset!r}")
    if p.arch not in ARCHS:
        raise ConfigError(f"client.params.arch must be one of {', '.join(ARCHS)}, got {p.arch!r}")
    if p.tasks not in TASK_FAMILIES:
        raise ConfigError(f"client.params.tasks must be one of {', '.join(TASK_FAMILIES)}, got {p.tasks!r}")
    if p.tasks == "teacher":
        _check_teacher(p, cfg)
    elif p.method == "oracle":
        raise ConfigError("client.params.method=oracle needs client.params.tasks=teacher (the teacher's base)")
    else:
        _check_pairs(p, cfg, env)
    _check_common(p, cfg, env)


def _check_teacher(p: LoraMetaParams, cfg: ExperimentConfig) -> None:
    """The teacher family: MNIST features into an MLP, T >= 1 tasks, the teacher's knobs."""
    if p.dataset != "mnist" or p.arch != "mlp":
        raise ConfigError(f"client.params.tasks=teacher needs dataset=mnist and arch=mlp (PCA features in, "
                          f"the teacher's own architecture), got dataset={p.dataset}, arch={p.arch}")
    if p.num_tasks < 1 or not 1 <= p.features <= 784 or p.teacher_scale < 0:
        raise ConfigError(f"client.params.num_tasks must be >= 1, features in [1, 784] and teacher_scale >= 0, "
                          f"got {p.num_tasks}, {p.features}, {p.teacher_scale}")
    layers = len(p.hidden) + 1
    if not -layers <= p.teacher_layer < layers:
        raise ConfigError(f"client.params.teacher_layer must index one of the {layers} linear layers "
                          f"(0 = first, -1 = head), got {p.teacher_layer}")
    if cfg.num_clients > p.num_tasks:
        raise ConfigError(f"num_clients={cfg.num_clients} but only {p.num_tasks} retraining tasks; "
                          f"use num_clients=1 (centralised) up to {p.num_tasks} (client = task)")


def _check_pairs(p: LoraMetaParams, cfg: ExperimentConfig, env: "TaskEnvironment") -> None:
    """The label-pair family: dataset / arch fit, valid and unseen pairs."""
    if env.is_text != (p.arch == "minilm"):
        raise ConfigError(f"client.params.arch={p.arch} does not fit dataset={p.dataset}: use arch minilm "
                          f"with a text dataset ({', '.join(TEXT_DATASETS)}) and mlp/mixer with images")
    if env.is_text and (not 2 <= p.max_len <= 512 or p.per_class < 2):
        raise ConfigError(f"client.params.max_len must be in [2, 512] (MiniLM's positions) and per_class >= 2, "
                          f"got {p.max_len} and {p.per_class}")
    pairs = [list(q) for q in p.train_pairs] + [list(p.new_pair)]
    flat = [d for q in pairs for d in q]
    k = env.num_classes
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


def _check_common(p: LoraMetaParams, cfg: ExperimentConfig, env: "TaskEnvironment") -> None:
    """Settings every task family shares: optimisation budgets, model sizes, shots."""
    if p.rank < 1 or p.local_steps < 1 or p.batch_size < 1 or p.ft_steps < 0 or p.ft_repeats < 1:
        raise ConfigError("client.params.rank, local_steps, batch_size, ft_repeats must be >= 1 and ft_steps >= 0")
    if min(p.lr, p.reptile_inner_lr, p.reptile_lr, p.ft_lr) <= 0 or p.weight_decay < 0:
        raise ConfigError("client.params.lr, reptile_inner_lr, reptile_lr, ft_lr must be > 0 (weight_decay >= 0)")
    if not 0.0 < p.test_fraction < 1.0:
        raise ConfigError(f"client.params.test_fraction must be in (0, 1), got {p.test_fraction}")
    if any(h < 1 for h in p.hidden) or p.dim < 1 or p.depth < 0:
        raise ConfigError("client.params.hidden widths and dim must be >= 1 and depth >= 0")
    if p.arch == "mixer" and (p.patch < 1 or env.image_shape[1] % p.patch):
        raise ConfigError(f"client.params.patch must divide the image size {env.image_shape[1]}, got {p.patch}")
    if any(not 0 <= s <= p.ft_steps for s in p.curve_points):
        raise ConfigError(f"client.params.curve_points must lie in [0, ft_steps={p.ft_steps}], "
                          f"got {p.curve_points}")
    pool = min(int((env.new_task.y_train == c).sum()) for c in (0, 1))
    if p.shots < 2 or p.shots % 2 or p.shots // 2 > pool:
        raise ConfigError(f"client.params.shots must be even, >= 2 and <= {2 * pool} (the new pair's shot pool), "
                          f"got {p.shots}")
    if cfg.strategy.fraction_train < 1.0:
        log.warning("lora_meta: fraction_train=%s, so unsampled task nodes skip their round",
                    cfg.strategy.fraction_train)
