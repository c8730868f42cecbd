"""The ``combo`` experiment: frozen backbones, a mini-VTAB suite, ComBo vs linear probes, relevance and top-k.

Per run: load (or pretrain and cache) the backbones; then per task build the data, extract every
backbone's token grids once (:class:`central.combo.features.FeatureBank`), and train on those cached
features (i) ComBo over all backbones, whose projection norms give the task relevance of each
backbone, (ii) ComBo retrained on the ``top_k`` most relevant backbones (selective adaptation),
(iii) a linear probe per backbone (layer and C picked on a validation split; ``probe_layer=last``:
the last layer only), (iv) a linear probe of all backbones' layers concatenated, and optionally
(``single``) (v) ComBo on each backbone alone — the probes differ from ComBo in the head as well as in
the number of backbones, and this separates the two.

``setting=text`` swaps the backbones and tasks for the text ones (:mod:`central.combo.text`,
:mod:`central.combo.text_tasks`: the pretrained MiniLM-L6, a random-init MiniLM, a bag of embeddings;
three ``stdlib_docs`` tasks); the head, relevance, top-k, probes and summaries are the same code.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

from fedsim.contracts.central import CentralContext
from central.combo.backbones import OBJECTIVES, BackboneRecipe, ConvNet, load_or_train
from central.combo.features import FeatureBank, TaskFeatures
from central.combo.head import HeadRecipe, predict, top_k, train_head
from central.combo.plots import accuracy_bars, relevance_heatmap
from central.combo.probes import ProbeRecipe, flatten, select_and_fit
from central.combo.tasks import POOL_SIZE, SIZE, TASKS, TaskData, build_task
from central.combo.text import CONTROL, LAYER_COUNT, TEXT_BACKBONES, TextExtractor
from central.combo.text_tasks import TEXT_POOL_SIZE, TEXT_TASKS
from fedsim.errors import ConfigError
from fedsim.registry import CENTRAL
from fedsim.threads import torch_threads

METHODS = ("combo", "topk", "single", "probe", "concat_probe")
DEFAULT_METHODS = ("combo", "topk", "probe", "concat_probe")
PROBE_LAYERS = ("best", "last")
MNIST_LOW = 2500  # MNIST digits 0–4 available for pretraining
SETTINGS = ("vision", "text")
MAX_POSITIONS = 512  # MiniLM's position embeddings


@dataclass
class ComboParams:
    setting: str = "vision"  # vision (small CNNs, mini-VTAB) | text (MiniLM, stdlib_docs tasks)
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))  # the first gives eval/mean_acc
    backbones: list[str] = field(default_factory=list)  # [] = the setting's: vision OBJECTIVES, text TEXT_BACKBONES
    tasks: list[str] = field(default_factory=list)  # [] = the setting's: vision TASKS, text TEXT_TASKS
    train_per_task: int = 300  # VTAB-1k style few-shot training sets
    test_per_task: int = 500
    data_seed: int = 0  # fixes the test sets (the run seed draws the training sets, backbones and heads)
    grid: int = 4  # common token grid: grid × grid tokens per (backbone, layer)
    max_len: int = 32  # text: MiniLM token ids per text ([CLS]/[SEP] included)
    text_tokens: int = 4  # text: tokens per (backbone, layer), chunks of each text's length
    top_k: int = 2  # backbones kept for selective adaptation
    null_control: bool = False  # also train ComBo on shuffled labels: the relevance spread that chance gives
    # ComBo head: one fixed recipe for every task (defaults and meanings: central.combo.head.HeadRecipe)
    proj_dim: int = HeadRecipe.proj_dim
    depth: int = HeadRecipe.depth
    heads: int = HeadRecipe.heads
    mlp_ratio: int = HeadRecipe.mlp_ratio
    dropout: float = HeadRecipe.dropout
    epochs: int = HeadRecipe.epochs
    batch: int = HeadRecipe.batch
    lr: float = HeadRecipe.lr
    weight_decay: float = HeadRecipe.weight_decay
    proj_init: float = HeadRecipe.proj_init
    # linear probes
    probe_layer: str = "best"  # best (layer chosen on the validation split) | last
    probe_cs: list[float] = field(default_factory=lambda: [0.01, 0.1, 1.0])
    val_frac: float = 0.2
    # backbone pretraining (cached on disk)
    widths: list[int] = field(default_factory=lambda: [16, 32, 64])
    pretrain_images: int = 2500
    pretrain_epochs: int = 10
    pretrain_lr: float = 2e-3


def _distinct(name: str, values: list[Any], allowed: tuple[str, ...] | None = None) -> None:
    if not values or len(set(values)) != len(values):
        raise ConfigError(f"params.{name} must be a non-empty list of distinct values, got {values}")
    if allowed is not None and set(values) - set(allowed):
        raise ConfigError(f"params.{name} must be names from {list(allowed)}, got {values}")


def _positive(p: ComboParams, *names: str, strict: bool = True) -> None:
    for name in names:
        value = getattr(p, name)
        if not (value > 0 if strict else value >= 0) or (isinstance(value, float) and not math.isfinite(value)):
            raise ConfigError(f"params.{name} must be {'> 0' if strict else '>= 0'}, got {value}")


def resolve(p: ComboParams) -> ComboParams:
    """``p`` with empty ``backbones`` / ``tasks`` replaced by the setting's defaults."""
    text = p.setting == "text"
    return replace(p, backbones=list(p.backbones) or list(TEXT_BACKBONES if text else OBJECTIVES),
                   tasks=list(p.tasks) or list(TEXT_TASKS if text else TASKS))


def check(p: ComboParams) -> None:
    if p.setting not in SETTINGS:
        raise ConfigError(f"params.setting must be one of {list(SETTINGS)}, got {p.setting!r}")
    p = resolve(p)
    _distinct("methods", p.methods, METHODS)
    if not 20 <= p.train_per_task:
        raise ConfigError(f"params.train_per_task must be >= 20, got {p.train_per_task}")
    if p.test_per_task < 1:
        raise ConfigError(f"params.test_per_task must be >= 1, got {p.test_per_task}")
    _positive(p, "proj_dim", "depth", "heads", "mlp_ratio", "epochs", "batch", "lr", "proj_init",
              "pretrain_epochs", "pretrain_lr", "pretrain_images")
    _positive(p, "weight_decay", strict=False)
    if not 0.0 <= p.dropout < 1.0:
        raise ConfigError(f"params.dropout must be in [0, 1), got {p.dropout}")
    if p.probe_layer not in PROBE_LAYERS:
        raise ConfigError(f"params.probe_layer must be one of {list(PROBE_LAYERS)}, got {p.probe_layer!r}")
    if not p.probe_cs or min(p.probe_cs) <= 0:
        raise ConfigError(f"params.probe_cs must be a non-empty list of values > 0, got {p.probe_cs}")
    if not 0.0 < p.val_frac <= 0.5:
        raise ConfigError(f"params.val_frac must be in (0, 0.5], got {p.val_frac}")
    (check_text if p.setting == "text" else check_vision)(p)
    if not 1 <= p.top_k <= len(p.backbones):
        raise ConfigError(f"params.top_k must be in [1, {len(p.backbones)}] (the number of backbones), got {p.top_k}")


def check_text(p: ComboParams) -> None:
    """The text setting's backbones, tasks, sequence length, token grid and head widths."""
    _distinct("backbones", p.backbones, TEXT_BACKBONES)
    _distinct("tasks", p.tasks, tuple(TEXT_TASKS))
    for task in p.tasks:
        pool = TEXT_POOL_SIZE.get(task)
        if pool is not None and p.train_per_task + p.test_per_task > pool:
            raise ConfigError(f"params.train_per_task + params.test_per_task must be <= {pool} for task {task}, "
                              f"got {p.train_per_task + p.test_per_task}")
    if not 3 <= p.max_len <= MAX_POSITIONS:
        raise ConfigError(f"params.max_len must be in [3, {MAX_POSITIONS}], got {p.max_len}")
    if not 1 <= p.text_tokens <= p.max_len:
        raise ConfigError(f"params.text_tokens must be in [1, params.max_len = {p.max_len}], got {p.text_tokens}")
    sizes = {len(p.backbones), p.top_k if "topk" in p.methods else len(p.backbones), 1 if "single" in p.methods
             else len(p.backbones)}
    for k in sizes:
        for subset in itertools.combinations(p.backbones, k):
            width = p.proj_dim * sum(LAYER_COUNT[n] for n in subset)
            if width % p.heads:
                raise ConfigError(f"params.heads ({p.heads}) must divide the transformer width proj_dim × layers "
                                  f"= {width} of backbones {list(subset)}")


def check_vision(p: ComboParams) -> None:
    """The image setting's backbones, tasks, pretraining, token grid and head widths."""
    _distinct("backbones", p.backbones, OBJECTIVES)
    _distinct("tasks", p.tasks, tuple(TASKS))
    for task in p.tasks:
        pool = POOL_SIZE[task]
        if pool is not None and p.train_per_task + p.test_per_task > pool:
            raise ConfigError(f"params.train_per_task + params.test_per_task must be <= {pool} for task {task}, "
                              f"got {p.train_per_task + p.test_per_task}")
    if len(p.widths) != 3 or min(p.widths) < 1:
        raise ConfigError(f"params.widths must be three positive conv widths, got {p.widths}")
    smallest = SIZE // 2 ** len(p.widths)
    if not 1 <= p.grid <= smallest:
        raise ConfigError(f"params.grid must be in [1, {smallest}] (the last layer's map is {smallest}×{smallest}), "
                          f"got {p.grid}")
    for k in {len(p.backbones), p.top_k}:
        if (p.proj_dim * len(p.widths) * k) % p.heads:
            raise ConfigError(f"params.heads ({p.heads}) must divide the transformer width proj_dim × layers × "
                              f"backbones = {p.proj_dim * len(p.widths) * k}")
    if {"supervised"} & set(p.backbones) and p.pretrain_images > MNIST_LOW:
        raise ConfigError(f"params.pretrain_images must be <= {MNIST_LOW} (MNIST digits 0–4 for the supervised "
                          f"backbone), got {p.pretrain_images}")


def head_recipe(p: ComboParams) -> HeadRecipe:
    return HeadRecipe(**{f.name: getattr(p, f.name) for f in fields(HeadRecipe)})


def backbone_recipe(p: ComboParams, objective: str, seed: int) -> BackboneRecipe:
    return BackboneRecipe(objective, tuple(p.widths), p.pretrain_images, p.pretrain_epochs, 64, p.pretrain_lr, seed)


def load_backbones(p: ComboParams, seed: int) -> tuple[dict[str, ConvNet], list[dict[str, Any]]]:
    """Every backbone of ``p.backbones`` (trained now or read from the disk cache), and one info row each."""
    nets, rows = {}, []
    for name in p.backbones:
        start = time.perf_counter()
        nets[name], info = load_or_train(backbone_recipe(p, name, seed))
        rows.append({"backbone": name, "objective_score": info["score"], "cached": bool(info["cached"]),
                     "seconds": time.perf_counter() - start})
    return nets, rows


def load_text_backbones(p: ComboParams, seed: int) -> tuple[FeatureBank, list[dict[str, Any]]]:
    """A feature bank over the text backbones (the models load lazily, once per process), and one info row each."""
    bank = FeatureBank(dict.fromkeys(p.backbones), p.text_tokens, extract=TextExtractor(p.text_tokens, seed))
    rows = [{"backbone": name, "layers": LAYER_COUNT[name], "max_len": p.max_len, "tokens": p.text_tokens}
            for name in p.backbones]
    return bank, rows


def make_task(p: ComboParams, name: str, train_seed: int) -> TaskData:
    if p.setting == "text":
        return TEXT_TASKS[name](p.train_per_task, p.test_per_task, p.max_len, p.data_seed, train_seed)
    return build_task(name, p.train_per_task, p.test_per_task, p.data_seed, train_seed)


# -- one task --------------------------------------------------------------------------------------

@dataclass
class TaskResult:
    task: str
    acc: dict[str, float] = field(default_factory=dict)  # method (or "probe/<backbone>") -> test accuracy
    relevance: list[float] | None = None  # per backbone, in params.backbones order
    null_relevance: list[float] | None = None  # the same, for a head trained on shuffled labels
    kept: list[str] = field(default_factory=list)
    probes: list[dict[str, Any]] = field(default_factory=list)
    n_classes: int = 0  # 0: unknown (no chance level logged)


def _acc(pred: torch.Tensor, y: torch.Tensor) -> float:
    return float((pred == y).float().mean())


def combo_and_topk(task: TaskData, feats: TaskFeatures, p: ComboParams, seed: int, out: TaskResult) -> None:
    """ComBo on all backbones (accuracy, relevance), if asked retrained on the top-k, and the null control."""
    recipe = head_recipe(p)
    head = train_head(feats.names, feats.train, task.y_train, task.n_classes, recipe, seed)
    out.acc["combo"] = _acc(predict(head, feats.test), task.y_test)
    scores = head.relevance()
    out.relevance = [float(s) for s in scores]
    if "topk" in p.methods:
        out.kept = top_k(feats.names, scores, p.top_k)
        sub = feats.select(out.kept)
        small = train_head(sub.names, sub.train, task.y_train, task.n_classes, recipe, seed)
        out.acc["topk"] = _acc(predict(small, sub.test), task.y_test)
    if p.null_control:
        perm = torch.randperm(len(task.y_train), generator=torch.Generator().manual_seed(seed))
        null = train_head(feats.names, feats.train, task.y_train[perm], task.n_classes, recipe, seed)
        out.null_relevance = [float(s) for s in null.relevance()]
        out.acc["null_combo"] = _acc(predict(null, feats.test), task.y_test)  # known: chance


def single_backbone_combos(task: TaskData, feats: TaskFeatures, p: ComboParams, seed: int, out: TaskResult) -> None:
    """ComBo on each backbone alone (same recipe and seed): does combining backbones beat the best one?"""
    for name in feats.names:
        sub = feats.select([name])
        head = train_head(sub.names, sub.train, task.y_train, task.n_classes, head_recipe(p), seed)
        out.acc[f"single/{name}"] = _acc(predict(head, sub.test), task.y_test)


def probes(task: TaskData, feats: TaskFeatures, p: ComboParams, seed: int, out: TaskResult) -> None:
    """The per-backbone probes and/or the concatenated probe."""
    recipe = ProbeRecipe(tuple(p.probe_cs), p.val_frac)
    y_tr, y_te = task.y_train.numpy(), task.y_test.numpy()
    if "probe" in p.methods:
        for name, tr, te in zip(feats.names, feats.train, feats.test):
            layers = range(len(tr)) if p.probe_layer == "best" else [len(tr) - 1]
            cands = {str(layer): (flatten([tr[layer]]), flatten([te[layer]])) for layer in layers}
            res = select_and_fit(cands, y_tr, y_te, recipe, seed)
            out.acc[f"probe/{name}"] = float(res["test_acc"])
            out.probes.append({"task": task.name, "probe": name, "layer": int(res["choice"]), **_probe_cols(res)})
    if "concat_probe" in p.methods:
        cands = {"all": (np.concatenate([flatten(m) for m in feats.train], 1),
                         np.concatenate([flatten(m) for m in feats.test], 1))}
        res = select_and_fit(cands, y_tr, y_te, recipe, seed)
        out.acc["concat_probe"] = float(res["test_acc"])
        out.probes.append({"task": task.name, "probe": "concat", "layer": "all", **_probe_cols(res)})


def _probe_cols(res: dict[str, Any]) -> dict[str, Any]:
    return {"C": res["c"], "val_acc": res["val_acc"], "test_acc": res["test_acc"]}


# -- summaries -------------------------------------------------------------------------------------

def rank_of(scores: list[float], index: int) -> int:
    """1 + the number of scores strictly above ``scores[index]`` (1 = most relevant)."""
    return 1 + sum(s > scores[index] for s in scores)


def spread(scores: list[float]) -> float:
    """(max − min) / mean of a task's relevance scores."""
    return (max(scores) - min(scores)) / float(np.mean(scores))


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (nan when either side is constant)."""
    from scipy.stats import spearmanr

    if len(set(a)) < 2 or len(set(b)) < 2:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def summarise(results: list[TaskResult], p: ComboParams) -> dict[str, float]:
    """The headline metrics (means over tasks) and the claim checks."""
    out: dict[str, float] = {}
    mean = lambda key: float(np.mean([r.acc[key] for r in results]))  # noqa: E731
    for r in results:
        out.update({f"acc/{r.task}/{k}": v for k, v in r.acc.items()})
        if r.relevance is not None:
            out.update({f"relevance/{r.task}/{n}": s for n, s in zip(p.backbones, r.relevance)})
    if "combo" in results[0].acc:
        out["eval/combo_mean_acc"] = mean("combo")
        ranks = {n: [rank_of(r.relevance or [], k) for r in results] for k, n in enumerate(p.backbones)}
        out.update({f"eval/relevance_rank/{n}": float(np.mean(v)) for n, v in ranks.items()})
        out["eval/relevance_spread"] = float(np.mean([spread(r.relevance or [0.0]) for r in results]))
        if results[0].null_relevance is not None:
            out["eval/null_relevance_spread"] = float(np.mean([spread(r.null_relevance or [0.0]) for r in results]))
            out["eval/null_combo_mean_acc"] = mean("null_combo")
        control = CONTROL if p.setting == "text" else "random"
        if control in p.backbones and len(p.backbones) > 1:
            k = p.backbones.index(control)
            others = [[s for j, s in enumerate(r.relevance or []) if j != k] for r in results]
            out["eval/random_rank_last_frac"] = float(np.mean([
                (r.relevance or [])[k] < min(o) for r, o in zip(results, others)]))
            out["eval/random_rank_first_frac"] = float(np.mean([
                (r.relevance or [])[k] > max(o) for r, o in zip(results, others)]))
    if "topk" in results[0].acc:
        out["eval/topk_mean_acc"] = mean("topk")
        out["claim/topk_minus_combo"] = out["eval/topk_mean_acc"] - out["eval/combo_mean_acc"]
    if "single" in p.methods:
        singles = {n: mean(f"single/{n}") for n in p.backbones}
        out.update({f"eval/single_combo_mean_acc/{n}": v for n, v in singles.items()})
        out["eval/best_single_combo_mean_acc"] = max(singles.values())
        if "eval/combo_mean_acc" in out:
            out["claim/combo_minus_best_single"] = out["eval/combo_mean_acc"] - out["eval/best_single_combo_mean_acc"]
            rhos = [spearman(r.relevance or [], [r.acc[f"single/{n}"] for n in p.backbones]) for r in results]
            rhos = [x for x in rhos if not math.isnan(x)]
            if rhos:
                out["eval/relevance_single_spearman"] = float(np.mean(rhos))
    if "probe" in p.methods:
        per_backbone = {n: mean(f"probe/{n}") for n in p.backbones}
        out.update({f"eval/probe_mean_acc/{n}": v for n, v in per_backbone.items()})
        out["eval/best_probe_mean_acc"] = max(per_backbone.values())
        out["eval/oracle_probe_mean_acc"] = float(np.mean([max(r.acc[f"probe/{n}"] for n in p.backbones)
                                                           for r in results]))
        if "eval/combo_mean_acc" in out:
            out["claim/combo_minus_best_probe"] = out["eval/combo_mean_acc"] - out["eval/best_probe_mean_acc"]
            rhos = [spearman(r.relevance or [], [r.acc[f"probe/{n}"] for n in p.backbones]) for r in results]
            rhos = [x for x in rhos if not math.isnan(x)]
            if rhos:  # (no metric when every task had tied scores)
                out["eval/relevance_probe_spearman"] = float(np.mean(rhos))
    if "concat_probe" in p.methods:
        out["eval/concat_probe_mean_acc"] = mean("concat_probe")
    if all(r.n_classes for r in results):
        out["eval/chance_mean_acc"] = float(np.mean([1.0 / r.n_classes for r in results]))
    first = {"combo": "eval/combo_mean_acc", "topk": "eval/topk_mean_acc", "single": "eval/best_single_combo_mean_acc",
             "probe": "eval/best_probe_mean_acc", "concat_probe": "eval/concat_probe_mean_acc"}[p.methods[0]]
    out["eval/mean_acc"] = out[first]
    return out


def accuracy_rows(results: list[TaskResult]) -> list[dict[str, Any]]:
    keys = list(results[0].acc)
    rows: list[dict[str, Any]] = [{"task": r.task, **r.acc} for r in results]
    rows.append({"task": "mean", **{k: float(np.mean([r.acc[k] for r in results])) for k in keys}})
    return rows


def relevance_rows(results: list[TaskResult], p: ComboParams) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        scores = r.relevance or []
        row: dict[str, Any] = {"task": r.task, **dict(zip(p.backbones, scores))}
        row["ranking"] = " > ".join(top_k(p.backbones, torch.tensor(scores), len(scores)))
        row["kept"] = ",".join(r.kept)
        if r.null_relevance is not None:
            row.update({f"null/{n}": v for n, v in zip(p.backbones, r.null_relevance)})
        rows.append(row)
    return rows


def bar_columns(results: list[TaskResult], p: ComboParams) -> dict[str, list[float]]:
    cols: dict[str, list[float]] = {}
    for key in ("combo", "topk"):
        if key in results[0].acc:
            cols["ComBo" if key == "combo" else f"ComBo top-{p.top_k}"] = [r.acc[key] for r in results]
    if "single" in p.methods:
        for n in p.backbones:
            cols[f"ComBo {n} only"] = [r.acc[f"single/{n}"] for r in results]
    if "probe" in p.methods:
        for n in p.backbones:
            cols[f"probe {n}"] = [r.acc[f"probe/{n}"] for r in results]
    if "concat_probe" in p.methods:
        cols["concat probe"] = [r.acc["concat_probe"] for r in results]
    return cols


# -- the method ------------------------------------------------------------------------------------

@CENTRAL.register("combo", params=ComboParams,
                  summary="ComBo: probe several frozen backbones at once (token-wise compression + small "
                          "transformer), rank them by projection norm, keep the top-k; vs linear probes "
                          "(mini-VTAB, or text: MiniLM)")
def run_combo(ctx: CentralContext) -> dict[str, float]:
    p: ComboParams = resolve(ctx.params)
    timing: dict[str, float] = {}
    with torch_threads(1):
        start = time.perf_counter()
        if p.setting == "text":
            bank, backbone_rows = load_text_backbones(p, ctx.seed("pretrain"))
        else:
            nets, backbone_rows = load_backbones(p, ctx.seed("pretrain"))
            bank = FeatureBank(nets, p.grid)
        timing["backbones_s"] = time.perf_counter() - start
        results = []
        with ctx.progress(len(p.tasks), "combo: tasks") as bar:
            for task_name in p.tasks:
                start = time.perf_counter()
                task = make_task(p, task_name, ctx.seed("train_set", task_name))
                feats = bank.features(task)
                out = TaskResult(task_name, n_classes=task.n_classes)
                if {"combo", "topk"} & set(p.methods):
                    combo_and_topk(task, feats, p, ctx.seed("head", task_name), out)
                if "single" in p.methods:
                    single_backbone_combos(task, feats, p, ctx.seed("head", task_name), out)
                probes(task, feats, p, ctx.seed("probe_val", task_name), out)
                bank.drop(task_name)
                results.append(out)
                timing[f"task_s/{task_name}"] = time.perf_counter() - start
                bar.advance()
    headline = summarise(results, p)
    ctx.log_table(accuracy_rows(results), "accuracy")
    ctx.log_table(backbone_rows, "backbones")
    if results[0].relevance is not None:
        ctx.log_table(relevance_rows(results, p), "relevance")
        scores = np.array([r.relevance for r in results], dtype=float)
        ctx.log_figure(relevance_heatmap(p.tasks, p.backbones, scores, {r.task: r.kept for r in results}),
                       "relevance_heatmap")
    if any(r.probes for r in results):
        ctx.log_table([row for r in results for row in r.probes], "probes")
    ctx.log_figure(accuracy_bars(p.tasks, bar_columns(results, p)), "accuracy_bars")
    ctx.log_params({f"combo/{k}": round(v, 2) for k, v in timing.items()})  # timing: not a metric (seed-stable)
    return headline


run_combo.check = check  # type: ignore[attr-defined]
