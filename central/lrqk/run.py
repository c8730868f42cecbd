"""The ``lrqk`` centralised method: LRQK vs full / recent-window / Quest-style / oracle top-k attention.

One run: load the LM (the kit's tiny ``target`` Llama, or SmolLM2-135M), tokenise one long held-out
stdlib file, run the exact prefill once, then replay ``decode_steps`` teacher-forced decode steps per
method and (r, k) setting with that method in every layer, against the full-attention replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fedsim.contracts.central import CentralContext
from central.lrqk.attend import Prefill, Replay, Shape, replay, run_prefill
from central.lrqk.factor import INITS
from central.lrqk.select import LRQKSelector, OracleSelector, QuestSelector, Selector, WindowSelector
from fedsim.errors import ConfigError
from fedsim.threads import torch_threads
from fedsim.registry import CENTRAL

MODELS = ("tiny", "smollm2", "test")
METHODS = ("lrqk", "quest", "window", "oracle")


@dataclass
class LRQKParams:
    model: str = "tiny"  # tiny = the kit's "target" Llama (4 layers, 4 heads × 64); smollm2 = SmolLM2-135M; test
    methods: list[str] = field(default_factory=lambda: list(METHODS))  # full attention always runs (the reference)
    ranks: list[int] = field(default_factory=lambda: [8, 16, 32])      # LRQK rank r
    topks: list[int] = field(default_factory=lambda: [32, 64, 128])    # k: tokens chosen among the non-recent ones
    window: int = 16            # recent ("lite") tokens always attended; every method's budget is k + window
    page_size: int = 16         # Quest page size (k // page_size pages selected)
    prefill_tokens: int = 1024
    decode_steps: int = 256
    lambda_q: float = 1.0       # prefill penalties (the code passes 1.0 everywhere)
    lambda_k: float = 1.0
    lambda_1: float = 1.0       # decode: weight of (q̂k̂ᵀ − qkᵀ)²
    lambda_2: float = 1.0       # decode: weight of ‖q̂A_Kᵀ − qK_Ωᵀ‖²
    prefill_iters: int = 2      # the code's max_iter = (2, 2)
    decode_iters: int = 2
    tol: float = 1e-8
    init: str = "randn"         # A_Q, A_K initialisation: randn (code default) | top | topcol
    headline_rank: int = 16
    headline_topk: int = 64
    file: str = ""              # held-out stdlib file (path relative to the stdlib or a unique suffix); "" = seeded pick
    threads: int = 1            # torch threads while decoding (tiny per-step ops: 1 is fastest on a shared CPU)


# -- models ---------------------------------------------------------------------------------------

def head_dim_of(model: str) -> int:
    if model == "smollm2":
        return 64
    from central.lm import tiny

    spec = tiny.preset("target" if model == "tiny" else "test")
    return spec.d_model // spec.n_heads


def load_model(model: str, progress: bool | None = None) -> tuple[Any, Callable[[str], list[int]], str]:
    """(model, encode, description); a cold tiny-LM cache is pre-trained with a logged line and a bar."""
    if model == "smollm2":
        from central.lm.smollm import load_smollm2

        lm, tok = load_smollm2()
        return lm, lambda text: tok.encode(text, add_special_tokens=False), "SmolLM2-135M-Instruct"
    from central.lm import tiny
    from central.lm.tokenizer import encode

    spec = tiny.preset("target" if model == "tiny" else "test")
    lm, card = tiny.load_or_train(spec, progress=progress, name=f"lrqk: tiny/{'target' if model == 'tiny' else 'test'}")
    tok = tiny.tokenizer_for(spec)
    return lm, lambda text: encode(tok, text), f"tiny-{'target' if model == 'tiny' else 'test'} ({card['parameters']} params)"


def pick_document(params: LRQKParams, encode: Callable[[str], list[int]], need: int,
                  rng: Any) -> tuple[str, torch.Tensor]:
    """One held-out file with at least ``need`` tokens: ``params.file``, or a seeded pick among them."""
    from central.lm.corpus import load_corpus, read_source

    corpus = load_corpus()
    names = {str(p.relative_to(corpus.root)): p for p in corpus.heldout_files}
    if params.file:
        hits = [n for n in names if n == params.file or n.endswith("/" + params.file)]
        if len(hits) != 1:
            raise ConfigError(f"params.file={params.file!r} matches {len(hits)} held-out files "
                              f"(e.g. {', '.join(sorted(names)[:3])})")
        ids = encode(read_source(names[hits[0]]))
        if len(ids) < need:
            raise ConfigError(f"{hits[0]} has {len(ids)} tokens; prefill_tokens + decode_steps + 1 = {need}")
        return hits[0], torch.tensor(ids[:need])
    long = sorted(n for n, p in names.items() if p.stat().st_size >= need * 2)  # cheap pre-filter (≥ 2 chars/token)
    eligible = [(n, ids) for n in long if len(ids := encode(read_source(names[n]))) >= need]
    if not eligible:
        raise ConfigError(f"no held-out file has {need} tokens; lower prefill_tokens or decode_steps")
    name, ids = eligible[int(rng.integers(len(eligible)))]
    return name, torch.tensor(ids[:need])


# -- settings and their metrics ------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    method: str
    topk: int
    rank: int = 0

    @property
    def label(self) -> str:
        return f"{self.method}(r={self.rank},k={self.topk})" if self.method == "lrqk" else f"{self.method}(k={self.topk})"


def settings_of(p: LRQKParams) -> list[Setting]:
    out = []
    for method in p.methods:
        for k in p.topks:
            out += [Setting(method, k, r) for r in p.ranks] if method == "lrqk" else [Setting(method, k)]
    return out


def selector_of(p: LRQKParams, s: Setting, generator: torch.Generator) -> Selector:
    if s.method == "lrqk":
        return LRQKSelector(s.topk, p.window, s.rank, lam_q=p.lambda_q, lam_k=p.lambda_k, lam1=p.lambda_1,
                            lam2=p.lambda_2, prefill_iters=p.prefill_iters, decode_iters=p.decode_iters,
                            tol=p.tol, init=p.init, generator=generator)
    if s.method == "quest":
        return QuestSelector(s.topk, p.window, p.page_size)
    if s.method == "window":
        return WindowSelector(s.topk, p.window)
    return OracleSelector(s.topk, p.window)


def fast_bytes(s: Setting | None, shape: Shape, window: int, page_size: int, T: int, elem: int) -> float:
    """Bytes of fast-memory ("GPU-side") state per layer at context length ``T``.

    Top-k buffers are per query head (as in the code, which repeats K/V to the query heads); the
    recent window is shared by a query group.
    """
    H, Hkv, d = shape.n_heads, shape.n_kv_heads, shape.head_dim
    if s is None:
        return 2 * Hkv * d * T * elem
    if s.method == "window":
        return 2 * Hkv * d * (s.topk + window) * elem
    resident = 2 * H * d * s.topk + 2 * Hkv * d * window
    if s.method == "lrqk":
        return (H * s.rank * T + 2 * H * s.rank * d + resident) * elem
    if s.method == "quest":
        return (2 * Hkv * d * math.ceil(T / page_size) + resident) * elem
    return (Hkv * d * T + resident) * elem  # oracle: needs every full-precision key to score exactly


def summarise(s: Setting, rep: Replay, full: Replay, shape: Shape, p: LRQKParams, T: int, elem: int) -> dict[str, Any]:
    recall = torch.stack([x.recall for x in rep.steps])            # (steps, layers, heads)
    err = torch.stack([x.out_err for x in rep.steps])
    copies = torch.stack([x.copies.sum() for x in rep.steps])      # rows per step, all layers and heads
    no_cache = torch.stack([x.copies_no_cache.sum() for x in rep.steps])
    mem = fast_bytes(s, shape, p.window, p.page_size, T, elem)
    full_mem = fast_bytes(None, shape, p.window, p.page_size, T, elem)
    return {"method": s.method, "rank": s.rank or "", "topk": s.topk, "budget": s.topk + p.window,
            "recall": float(recall.mean()), "recall_min_layer": float(recall.mean((0, 2)).min()),
            "out_err": float(err.mean()), "loss": float(rep.losses.mean()),
            "dloss": float(rep.losses.mean() - full.losses.mean()),
            "copies_per_step": float(copies.mean()), "copies_per_step_no_cache": float(no_cache.mean()),
            "copy_cut": float(no_cache.mean() / copies.mean()) if copies.mean() > 0 else float("nan"),
            "fast_bytes_per_token": mem * shape.n_layers / T, "mem_frac": mem / full_mem,
            "seconds": rep.seconds}


# -- checks ---------------------------------------------------------------------------------------

def _positive(name: str, values: list[int]) -> None:
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise ConfigError(f"params.{name} must be a non-empty list of distinct integers >= 1, got {values}")


def check(p: LRQKParams) -> None:
    """One-line ConfigErrors for bad values (before any MLflow run starts)."""
    if p.model not in MODELS:
        raise ConfigError(f"params.model must be one of {', '.join(MODELS)}, got {p.model!r}")
    if not p.methods or len(set(p.methods)) != len(p.methods) or not set(p.methods) <= set(METHODS):
        raise ConfigError(f"params.methods must be distinct names among {', '.join(METHODS)}, got {p.methods}")
    _positive("ranks", p.ranks)
    _positive("topks", p.topks)
    d = head_dim_of(p.model)
    if max(p.ranks) > d:
        raise ConfigError(f"params.ranks must be <= the head dimension {d} of {p.model}, got {max(p.ranks)}")
    if p.window < 1 or p.page_size < 1 or p.decode_steps < 1:
        raise ConfigError("params.window, params.page_size and params.decode_steps must be >= 1")
    if "quest" in p.methods and any(k % p.page_size for k in p.topks):
        raise ConfigError(f"Quest selects k / page_size whole pages: every k in {p.topks} must be a multiple "
                          f"of page_size={p.page_size}")
    if p.prefill_tokens < max(p.topks) + p.window or p.prefill_tokens < max(p.ranks):
        raise ConfigError(f"params.prefill_tokens={p.prefill_tokens} must be >= max(topks) + window "
                          f"= {max(p.topks) + p.window} (the code asserts seq_len >= k) and >= max(ranks)")
    if min(p.lambda_q, p.lambda_k, p.lambda_1, p.lambda_2) < 0 or p.tol < 0:
        raise ConfigError("the lambda_* penalties and tol must be >= 0")
    if p.prefill_iters < 1 or p.decode_iters < 1 or p.threads < 1:
        raise ConfigError("params.prefill_iters, decode_iters and threads must be >= 1")
    if p.init not in INITS:
        raise ConfigError(f"params.init must be one of {', '.join(INITS)}, got {p.init!r}")
    if p.headline_topk not in p.topks or ("lrqk" in p.methods and p.headline_rank not in p.ranks):
        raise ConfigError(f"params.headline_topk must be in topks {p.topks} and headline_rank in ranks {p.ranks}")


# -- plots ----------------------------------------------------------------------------------------

def _plot_vs_k(rows: list[dict[str, Any]], p: LRQKParams, key: str, ylabel: str, full_value: float | None):
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in p.ranks if "lrqk" in p.methods else []:
        pts = sorted((x["topk"], x[key]) for x in rows if x["method"] == "lrqk" and x["rank"] == r)
        ax.plot(*zip(*pts), marker="o", label=f"LRQK r={r}")
    styles = {"quest": ("s", "--"), "window": ("^", ":"), "oracle": ("*", "-.")}
    for m in [m for m in p.methods if m != "lrqk"]:
        pts = sorted((x["topk"], x[key]) for x in rows if x["method"] == m)
        ax.plot(*zip(*pts), marker=styles[m][0], linestyle=styles[m][1], color="k" if m == "oracle" else None,
                label={"quest": "Quest-style pages", "window": "recent window", "oracle": "exact top-k"}[m])
    if full_value is not None:
        ax.axhline(full_value, color="grey", lw=0.8, label="full attention")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"k (tokens selected; budget = k + {p.window} recent)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _plot_copies(curves: dict[str, tuple[torch.Tensor, torch.Tensor]]):
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (with_cache, without) in curves.items():
        line, = ax.plot(with_cache.numpy(), label=f"{label}: hit/miss cache")
        ax.plot(without.numpy(), linestyle="--", color=line.get_color(), label=f"{label}: no cache")
    ax.set_xlabel("decode step")
    ax.set_ylabel("K/V rows copied (all layers and heads)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


# -- the method -----------------------------------------------------------------------------------

@CENTRAL.register("lrqk", params=LRQKParams,
                  summary="LRQK low-rank query-key KV selection (penalised ALS) vs full/window/Quest attention")
def run_lrqk(ctx: CentralContext) -> dict[str, float]:
    p: LRQKParams = ctx.params
    model, encode, model_desc = load_model(p.model, ctx.show_progress)
    need = p.prefill_tokens + p.decode_steps + 1
    doc, ids = pick_document(p, encode, need, ctx.rng("document"))
    shape = Shape.of(model)
    T = p.prefill_tokens + p.decode_steps
    elem = next(model.parameters()).element_size()
    ctx.log_params({"document": doc, "model_desc": model_desc})
    todo = settings_of(p)
    rows: list[dict[str, Any]] = []
    replays: dict[Setting, Replay] = {}
    with torch_threads(p.threads), ctx.progress(len(todo) + 1, f"lrqk on {doc}") as bar:
        pre: Prefill = run_prefill(model, ids, p.prefill_tokens)
        full = replay(model, ids, pre, p.decode_steps, None)
        bar.advance()
        for i, s in enumerate(todo, 1):
            rep = replay(model, ids, pre, p.decode_steps, selector_of(p, s, ctx.generator("als", s.label)))
            row = {"setting": s.label, **summarise(s, rep, full, shape, p, T, elem)}
            rows.append(row)
            replays[s] = rep
            ctx.log_metrics({f"sweep/{k}": float(v) for k, v in row.items() if k in ("recall", "out_err", "dloss")}, i)
            bar.advance()
    full_row = {"setting": "full", "method": "full", "rank": "", "topk": "", "budget": T, "recall": 1.0,
                "recall_min_layer": 1.0, "out_err": 0.0, "loss": float(full.losses.mean()), "dloss": 0.0,
                "copies_per_step": 0.0, "copies_per_step_no_cache": 0.0, "copy_cut": float("nan"),
                "fast_bytes_per_token": fast_bytes(None, shape, p.window, p.page_size, T, elem) * shape.n_layers / T,
                "mem_frac": 1.0, "seconds": full.seconds}
    ctx.log_table([full_row, *rows], "sweep")
    ctx.log_table([{"model": model_desc, "document": doc, "prefill_tokens": p.prefill_tokens,
                    "decode_steps": p.decode_steps, "layers": shape.n_layers, "heads": shape.n_heads,
                    "kv_heads": shape.n_kv_heads, "head_dim": shape.head_dim, "full_loss": float(full.losses.mean()),
                    "prefill_seconds": pre.seconds}], "setup")
    head = {s: next(x for x in rows if x["setting"] == s.label) for s in todo
            if s.topk == p.headline_topk and (s.method != "lrqk" or s.rank == p.headline_rank)}
    ctx.log_table(_per_layer(head, replays), "per_layer_headline")
    ctx.log_figure(_plot_vs_k(rows, p, "recall", "attention-mass recall", 1.0), "recall_vs_k")
    ctx.log_figure(_plot_vs_k(rows, p, "dloss", "Δ next-token loss vs full (nats)", 0.0), "dloss_vs_k")
    ctx.log_figure(_plot_vs_k(rows, p, "out_err", "relative L2 error of attention output", None), "out_err_vs_k")
    curves = {s.label: (torch.stack([x.copies.sum() for x in replays[s].steps]),
                        torch.stack([x.copies_no_cache.sum() for x in replays[s].steps]))
              for s in head if s.method in ("lrqk", "quest")}
    if curves:
        ctx.log_figure(_plot_copies(curves), "copies_per_step")
    return _headline(p, head, float(full.losses.mean()))


def _per_layer(head: dict[Setting, dict[str, Any]], replays: dict[Setting, Replay]) -> list[dict[str, Any]]:
    out = []
    for s in head:
        recall = torch.stack([x.recall for x in replays[s].steps]).mean((0, 2))
        err = torch.stack([x.out_err for x in replays[s].steps]).mean((0, 2))
        out += [{"setting": s.label, "layer": i, "recall": float(a), "out_err": float(b)}
                for i, (a, b) in enumerate(zip(recall, err))]
    return out


def _headline(p: LRQKParams, head: dict[Setting, dict[str, Any]], full_loss: float) -> dict[str, float]:
    out: dict[str, float] = {"loss/full": full_loss}
    for s, row in head.items():
        for key in ("recall", "out_err", "dloss"):
            out[f"{key}/{s.method}"] = row[key]
        if s.method in ("lrqk", "quest"):
            out[f"copies_per_step/{s.method}"] = row["copies_per_step"]
            out[f"copies_per_step_no_cache/{s.method}"] = row["copies_per_step_no_cache"]
            out[f"copy_cut/{s.method}"] = row["copy_cut"]
        out[f"mem_frac/{s.method}"] = row["mem_frac"]
    first = next(s for s in head if s.method == p.methods[0])
    out["headline/recall"], out["headline/dloss"] = head[first]["recall"], head[first]["dloss"]
    out["headline/out_err"] = head[first]["out_err"]
    return out


run_lrqk.check = check  # type: ignore[attr-defined]
