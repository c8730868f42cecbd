"""The ``deft`` experiment: pretrain on old classes, adapt few-shot to new ones, trace adapt vs retain.

For every method and rank the pretrained backbone is copied, the method's adapter is attached to the
target layers (or, for ``full``, every backbone weight trains; for ``head``, none does), and a fresh
linear head for the new classes trains together with it: full-batch Adam on the few-shot set for
``steps`` steps.  At each step in ``eval_steps`` it records the new-task accuracy (new head, new test
rows) and the retention (the frozen old head on the adapted backbone, old test rows).  The points
over ranks × checkpoints trace each method's trade-off; its Pareto front and hypervolume (reference:
chance on both tasks, normalised to 1 for a perfect model) summarise it.
"""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsim.contracts.central import CentralContext
from central.deft.data import Split, Tasks, few_shot, mnist_arrays, split_tasks, text_arrays
from central.deft.layers import DEFT_INITS, AdapterSpec, max_rank, wrap_model
from central.deft.models import (CNN_TARGETS, MINILM_TARGETS, PretrainRecipe, SmallCNN, accuracy, minilm_prefix_states,
                                 minilm_tail, pretrained_cnn, train_probe)
from central.deft.tradeoff import best_new_at_retention, normalised_hypervolume, pareto_front
from fedsim.errors import ConfigError
from fedsim.registry import CENTRAL
from fedsim.threads import torch_threads

#: method -> (adapter kind, q_mode); ``full`` and ``head`` are the references without an adapter.
ADAPTER_METHODS: dict[str, tuple[str, str]] = {"deft_cached": ("deft", "cached"), "deft_trained": ("deft", "trained"),
                                               "lora": ("lora", "cached"), "para": ("para", "cached")}
REFERENCES = ("full", "head")
METHODS = (*ADAPTER_METHODS, *REFERENCES)
SETTINGS = ("mnist", "text")
MNIST_PER_CLASS = 500
MINILM_HIDDEN = 384


@dataclass
class DeftParams:
    setting: str = "mnist"  # mnist (CNN, default) | text (MiniLM on stdlib_docs)
    methods: list[str] = field(default_factory=lambda: list(METHODS))  # the first gives the plain headline keys
    ranks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # adapter ranks swept (full/head: rank-free)
    rank: int = 4  # the rank of the per-method headline numbers (one of ranks)
    steps: int = 100
    eval_steps: list[int] = field(default_factory=lambda: [0, 10, 25, 50, 100])  # checkpoints; the last = steps
    lrs: list[float] = field(default_factory=lambda: [1e-3, 1e-2])  # Adam learning rates swept (adapters, head)
    lr: float = 1e-2  # the learning rate of the per-method headline numbers (one of lrs)
    full_lr_scale: float = 0.1  # full fine-tune: backbone lr = lr × this (its head: lr)
    shots: int = 10  # training examples per new class
    # DEFT (the authors' KnowledgeInjectionConfig defaults) and LoRA
    gate: bool = False
    init_scale: float = 1.0
    deft_init: str = "authors"  # authors | preserve (R0 = QᵀW, so W′ = W at step 0; ablation)
    lora_alpha: float = 8.0
    retain_frac: float = 0.95  # new_at_retain: best new accuracy keeping this fraction of the old accuracy
    # data
    old_classes: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    test_per_class: int = 100
    split_seed: int = 0  # fixed test rows; the run seed draws the shots, the pretraining and the adapters
    # pretraining of the CNN (mnist)
    widths: list[int] = field(default_factory=lambda: [16, 32, 64])  # conv1, conv2, fc1 channels/units
    pretrain_epochs: int = 5
    pretrain_lr: float = 1e-3
    # text setting
    text_max_len: int = 32
    text_per_class: int = 120
    probe_steps: int = 300


def _distinct(name: str, values: list[Any]) -> None:
    if not values or len(set(values)) != len(values):
        raise ConfigError(f"params.{name} must be a non-empty list of distinct values, got {values}")


def _rank_limit(p: DeftParams) -> dict[str, int]:
    """Largest rank each adapter kind accepts on every target layer of the setting."""
    if p.setting == "text":
        return {"deft": MINILM_HIDDEN, "lora": MINILM_HIDDEN, "para": MINILM_HIDDEN - 1}
    cnn = SmallCNN(*p.widths)
    return {kind: min(max_rank(kind, cnn.get_submodule(t)) for t in CNN_TARGETS) for kind in ("deft", "lora", "para")}


def check(p: DeftParams) -> None:
    if p.setting not in SETTINGS:
        raise ConfigError(f"params.setting must be one of {list(SETTINGS)}, got {p.setting!r}")
    _distinct("methods", p.methods)
    if set(p.methods) - set(METHODS):
        raise ConfigError(f"params.methods must be names from {list(METHODS)}, got {p.methods}")
    _distinct("ranks", p.ranks)
    if min(p.ranks) < 1 or p.rank not in p.ranks:
        raise ConfigError(f"params.ranks must be >= 1 and contain params.rank={p.rank}, got {p.ranks}")
    _distinct("eval_steps", p.eval_steps)
    if p.steps < 1 or sorted(p.eval_steps) != p.eval_steps or p.eval_steps[0] < 0 or p.eval_steps[-1] != p.steps:
        raise ConfigError(f"params.eval_steps must increase from >= 0 to steps={p.steps} (>= 1), got {p.eval_steps}")
    _distinct("lrs", p.lrs)
    if min(p.lrs) <= 0 or p.lr not in p.lrs:
        raise ConfigError(f"params.lrs must be > 0 and contain params.lr={p.lr}, got {p.lrs}")
    for name in ("full_lr_scale", "init_scale", "lora_alpha", "pretrain_lr"):
        if not getattr(p, name) > 0:
            raise ConfigError(f"params.{name} must be > 0, got {getattr(p, name)}")
    if p.deft_init not in DEFT_INITS:
        raise ConfigError(f"params.deft_init must be one of {list(DEFT_INITS)}, got {p.deft_init!r}")
    if not 0.0 < p.retain_frac <= 1.0:
        raise ConfigError(f"params.retain_frac must be in (0, 1], got {p.retain_frac}")
    _distinct("old_classes", p.old_classes)
    if not set(p.old_classes) <= set(range(10)) or not 2 <= len(p.old_classes) <= 8:
        raise ConfigError(f"params.old_classes must be 2..8 distinct classes in 0..9, got {p.old_classes}")
    per_class = MNIST_PER_CLASS if p.setting == "mnist" else p.text_per_class
    if not 1 <= p.test_per_class < per_class:
        raise ConfigError(f"params.test_per_class must be in [1, {per_class - 1}], got {p.test_per_class}")
    if not 1 <= p.shots <= per_class - p.test_per_class:
        raise ConfigError(f"params.shots must be in [1, {per_class - p.test_per_class}] (the pool per class), "
                          f"got {p.shots}")
    if len(p.widths) != 3 or min(p.widths) < 1:
        raise ConfigError(f"params.widths must be three positive sizes (conv1, conv2, fc1), got {p.widths}")
    for name in ("pretrain_epochs", "probe_steps", "text_per_class"):
        if getattr(p, name) < 1:
            raise ConfigError(f"params.{name} must be >= 1, got {getattr(p, name)}")
    if not 4 <= p.text_max_len <= 512:
        raise ConfigError(f"params.text_max_len must be in [4, 512], got {p.text_max_len}")
    limits = _rank_limit(p)
    for method in p.methods:
        if method in ADAPTER_METHODS:
            kind = ADAPTER_METHODS[method][0]
            if max(p.ranks) > limits[kind]:
                raise ConfigError(f"params.ranks: {method} accepts ranks <= {limits[kind]} on this model, "
                                  f"got {max(p.ranks)}")


# -- the two settings -------------------------------------------------------------------------------

@dataclass
class Setting:
    """A pretrained backbone with its frozen old head, the layers to adapt, and the two tasks."""

    backbone: nn.Module
    old_head: nn.Linear
    targets: list[str]
    tasks: Tasks
    info: dict[str, float]


def mnist_setting(p: DeftParams, seed: int) -> Setting:
    x, y, _ = mnist_arrays()
    tasks = split_tasks(x, y, p.old_classes, p.test_per_class, p.split_seed)
    recipe = PretrainRecipe(*p.widths, epochs=p.pretrain_epochs, lr=p.pretrain_lr, seed=seed,
                            old_classes=tuple(sorted(p.old_classes)), test_per_class=p.test_per_class,
                            split_seed=p.split_seed)
    start = time.perf_counter()
    backbone, head, cached = pretrained_cnn(recipe, tasks.old_train, len(tasks.old_classes))
    return Setting(backbone, head, list(CNN_TARGETS), tasks,
                   {"pretrain/cached": float(cached), "pretrain/seconds": time.perf_counter() - start})


@functools.lru_cache(maxsize=2)
def _text_states(max_len: int, per_class: int, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """MiniLM's last-layer inputs for every ``stdlib_docs`` row (cached per process)."""
    ids, y, _ = text_arrays(max_len, per_class, split_seed)
    return minilm_prefix_states(torch.from_numpy(ids)).numpy(), y


def text_setting(p: DeftParams, seed: int) -> Setting:
    start = time.perf_counter()
    states, y = _text_states(p.text_max_len, p.text_per_class, p.split_seed)
    tasks = split_tasks(states, y, p.old_classes, p.test_per_class, p.split_seed)
    tail = minilm_tail()
    with torch.no_grad():
        feats = tail(tasks.old_train.x)
    head = train_probe(feats, tasks.old_train.y, len(tasks.old_classes), p.probe_steps, 1e-2, seed)
    return Setting(tail, head, [f"layer.{t}" for t in MINILM_TARGETS], tasks,
                   {"pretrain/cached": 0.0, "pretrain/seconds": time.perf_counter() - start})


# -- one adaptation run -----------------------------------------------------------------------------

def fresh_head(in_dim: int, n_classes: int, seed: int) -> nn.Linear:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Linear(in_dim, n_classes)


def prepare(setting: Setting, method: str, rank: int, p: DeftParams, gen: torch.Generator) -> tuple[nn.Module, int, int]:
    """A copy of the backbone set up for ``method``; with its nominal and effective trainable counts."""
    backbone = copy.deepcopy(setting.backbone)
    if method in ADAPTER_METHODS:
        kind, q_mode = ADAPTER_METHODS[method]
        spec = AdapterSpec(kind, rank, q_mode, p.gate, p.init_scale, p.deft_init, p.lora_alpha)
        adapters = wrap_model(backbone, setting.targets, spec, gen)
        nominal = sum(q.numel() for q in backbone.parameters() if q.requires_grad)
        return backbone, nominal, sum(a.effective_parameters() for a in adapters.values())
    for q in backbone.parameters():
        q.requires_grad_(method == "full")
    nominal = sum(q.numel() for q in backbone.parameters() if q.requires_grad)
    return backbone, nominal, nominal


def adapt(setting: Setting, method: str, rank: int, lr: float, shots: Split, p: DeftParams,
          ctx: CentralContext) -> list[dict[str, Any]]:
    """Train ``method`` at ``rank`` with learning rate ``lr`` on the few-shot set; one row per checkpoint."""
    backbone, nominal, effective = prepare(setting, method, rank, p, ctx.generator("adapter", method, rank))
    head = fresh_head(setting.backbone.out_dim, len(setting.tasks.new_classes), ctx.seed("new_head"))
    groups = [{"params": list(head.parameters()), "lr": lr}]
    trainable = [q for q in backbone.parameters() if q.requires_grad]
    if trainable:
        groups.append({"params": trainable, "lr": lr * p.full_lr_scale if method == "full" else lr})
    opt = torch.optim.Adam(groups)
    tag = (method if method in REFERENCES else f"{method}/r{rank}") + f"/lr{lr:g}"
    rows, start = [], time.perf_counter()
    for step in range(p.steps + 1):
        if step in p.eval_steps:
            row = {"method": method, "rank": rank, "lr": lr, "step": step,
                   "trainable": nominal, "effective_trainable": effective,
                   "new_acc": accuracy(backbone, head, setting.tasks.new_test),
                   "retention": accuracy(backbone, setting.old_head, setting.tasks.old_test)}
            rows.append(row)
            ctx.log_metrics({f"curve/new_acc/{tag}": row["new_acc"], f"curve/retention/{tag}": row["retention"]}, step)
        if step == p.steps:
            break
        loss = F.cross_entropy(head(backbone(shots.x)), shots.y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for row in rows:
        row["seconds"] = time.perf_counter() - start
    return rows


# -- summaries and plots ----------------------------------------------------------------------------

def summarise(rows: list[dict[str, Any]], p: DeftParams, old_acc: float, chance: tuple[float, float]) -> list[dict[str, Any]]:
    """One row per method: trade-off hypervolume, best new accuracy at the retention floor, final point at ``rank``."""
    out = []
    for method in p.methods:
        mine = [r for r in rows if r["method"] == method]
        points = [(r["retention"], r["new_acc"]) for r in mine]
        at_rank = [r for r in mine if r["rank"] in (p.rank, 0) and r["lr"] == p.lr]
        final = max(at_rank, key=lambda r: r["step"])
        out.append({"method": method, "hv": normalised_hypervolume(points, chance),
                    "new_at_retain": best_new_at_retention(points, p.retain_frac * old_acc, chance[1]),
                    "new_acc": final["new_acc"], "retention": final["retention"],
                    "trainable": final["trainable"], "effective_trainable": final["effective_trainable"],
                    "front_points": len(pareto_front(points))})
    return out


def headline(p: DeftParams, summary: list[dict[str, Any]], old_acc: float) -> dict[str, float]:
    """The run's metrics: ``pretrained/old_acc``, then ``<key>/<method>`` for every method and the plain
    ``<key>`` of the first method (keys: hv, new_at_retain, new_acc, retention, trainable,
    effective_trainable).

    No "DEFT beats LoRA" flag: one seed's comparison has no margin and no interval.  Which method beats
    which is decided by ``fedsim reproduce deft`` (``experiments/reproduce/deft.yaml``: paired seeds, an
    interval on the mean difference, a margin and positive controls).
    """
    by = {e["method"]: e for e in summary}
    out: dict[str, float] = {"pretrained/old_acc": old_acc}
    keys = ("hv", "new_at_retain", "new_acc", "retention", "trainable", "effective_trainable")
    for method, entry in by.items():
        out.update({f"{k}/{method}": float(entry[k]) for k in keys})
    out.update({k: float(by[p.methods[0]][k]) for k in keys})
    return out


_COLORS = {"deft_cached": "tab:red", "deft_trained": "tab:orange", "lora": "tab:blue", "para": "tab:green",
           "full": "black", "head": "tab:gray"}
_MARKERS = {0: "s", 1: "v", 2: "^", 4: "o", 8: "D", 16: "P", 32: "*"}


def plot_tradeoff(rows: list[dict[str, Any]], p: DeftParams, old_acc: float) -> Any:
    """Every (retention, new accuracy) point and each method's Pareto front; right panel zoomed."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.6), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax in axes:
        for method in p.methods:
            mine = [r for r in rows if r["method"] == method]
            color = _COLORS[method]
            for rank in dict.fromkeys(r["rank"] for r in mine):
                pts = [r for r in mine if r["rank"] == rank]
                ax.scatter([r["retention"] for r in pts], [r["new_acc"] for r in pts], s=14, color=color,
                           alpha=0.55, marker=_MARKERS.get(rank, "o"))
            front = pareto_front([(r["retention"], r["new_acc"]) for r in mine])
            ax.plot(*zip(*front), color=color, lw=1.6, label=method, drawstyle="steps-post", marker="o", ms=6,
                    mfc="none")
        ax.axvline(old_acc, color="gray", ls=":", lw=1)
        ax.axvline(p.retain_frac * old_acc, color="gray", ls="--", lw=0.8)
        ax.set_xlabel("retention: old-task accuracy (old head, adapted backbone)")
        ax.grid(alpha=0.3)
    low = p.retain_frac * old_acc - 0.08
    axes[1].set_xlim(low, old_acc + 0.01)
    axes[1].set_ylim(bottom=max([r["new_acc"] for r in rows if r["retention"] >= low] + [0.0]) - 0.35)
    axes[0].set_ylabel("new-task accuracy (new head)")
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"{p.setting}: ranks {p.ranks} × lrs {p.lrs} × steps {p.eval_steps}\n"
                      f"lines: Pareto fronts; marker: rank (■ = full/head); dotted: pretrained", fontsize=9)
    axes[1].set_title(f"zoom on high retention (dashed: {p.retain_frac:g} × pretrained)", fontsize=9)
    return fig


def plot_curves(rows: list[dict[str, Any]], p: DeftParams) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.4), layout="constrained")
    axes = fig.subplots(1, 2)
    for method in p.methods:
        pts = [r for r in rows if r["method"] == method and r["rank"] in (p.rank, 0) and r["lr"] == p.lr]
        for ax, key in zip(axes, ("new_acc", "retention")):
            ax.plot([r["step"] for r in pts], [r[key] for r in pts], marker=".", color=_COLORS[method], label=method)
    for ax, key in zip(axes, ("new-task accuracy", "retention (old-task accuracy)")):
        ax.set_xlabel("adaptation step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{p.setting}: training curves at rank {p.rank}, lr {p.lr:g}", fontsize=10)
    return fig


# -- the method -------------------------------------------------------------------------------------

def runs_of(p: DeftParams) -> list[tuple[str, int, float]]:
    """(method, rank, lr): every rank for the adapters, rank 0 for the rank-free references; every lr."""
    return [(m, r, lr) for m in p.methods for r in (p.ranks if m in ADAPTER_METHODS else [0]) for lr in p.lrs]


@CENTRAL.register("deft", params=DeftParams,
                  summary="DEFT (W − QQᵀW + QR) vs LoRA, PaRa, full fine-tune: few-shot adaptation to new "
                          "classes vs retention of old ones (MNIST CNN or MiniLM)")
def run_deft(ctx: CentralContext) -> dict[str, float]:
    p: DeftParams = ctx.params
    with torch_threads(1):
        setting = (mnist_setting if p.setting == "mnist" else text_setting)(p, ctx.seed("pretrain"))
        old_acc = accuracy(setting.backbone, setting.old_head, setting.tasks.old_test)
        shots = few_shot(setting.tasks.new_pool, p.shots, ctx.rng("shots"))
        rows: list[dict[str, Any]] = []
        runs = runs_of(p)
        with ctx.progress(len(runs), "deft: adapting") as bar:
            for method, rank, lr in runs:
                rows += adapt(setting, method, rank, lr, shots, p, ctx)
                bar.advance()
    chance = (1.0 / len(setting.tasks.old_classes), 1.0 / len(setting.tasks.new_classes))
    summary = summarise(rows, p, old_acc, chance)
    ctx.log_table(summary, "summary")
    ctx.log_table(rows, "points")
    ctx.log_figure(plot_tradeoff(rows, p, old_acc), "tradeoff")
    ctx.log_figure(plot_curves(rows, p), "curves")
    ctx.log_params({f"deft/{k}": v for k, v in setting.info.items()})  # timing: not a metric (seed-stable metrics)
    return headline(p, summary, old_acc)


run_deft.check = check  # type: ignore[attr-defined]
