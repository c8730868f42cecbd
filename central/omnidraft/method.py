"""The registered ``omnidraft`` method: the stream of held-out stdlib prompts, variants (a)-(d), metrics."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedsim.contracts.central import CentralContext
from central.lm import tiny
from central.lm.corpus import load_corpus, read_source
from central.omnidraft.checks import exactness_check, greedy_identical
from central.omnidraft.decode import VARIANTS, CachedLM, DecodeConfig, SpecDecoder, Stats, target_only
from central.omnidraft.online import AcceptanceHead, OnlineDistiller
from central.omnidraft.vocab import VocabBridge, backend, special_tokens
from fedsim.errors import ConfigError
from fedsim.registry import CENTRAL


@dataclass
class OmniDraftParams:
    # models
    target: str = "tiny"  # "tiny" (kit preset) or "smollm2" (SmolLM2-135M-Instruct, its own tokenizer)
    target_preset: str = "target"
    target_vocab: int = 0  # 0 = the preset's
    drafter_preset: str = "drafter"
    drafter_vocab: int = 0
    dtype: str = "float32"  # "float64" makes chunked and one-token forwards agree to ~1e-15
    threads: int = 1  # torch CPU threads during the run (1 is far faster for tiny models on a busy machine)
    lean_forward: bool = True  # decode both models with central.lm.lean (same function, ~3x less overhead per
    #                            forward for the tiny LMs); false: transformers' forward, as before issue #26's profile
    # the stream
    variants: str = "abcd"  # letters of the variants to run, in order; the last one gives the unsuffixed headline
    shuffle_stream: bool = True  # visit the held-out files in a seeded order (False: sorted by path)
    prompts: int = 12
    prompt_tokens: int = 64
    new_tokens: int = 64
    # decoding
    mode: str = "greedy"  # "greedy" or "sample" (speculative sampling at `temperature`)
    temperature: float = 1.0
    k: int = 6  # max draft tokens per block
    drafter_window: int = 128  # the drafter's context is cut to its last half past this (its training length)
    ngram_max: int = 6  # longest draft run the n-gram cache stores
    cache_prompt: bool = False  # [I] also fill the n-gram cache from the prompt's target tokens
    # (c) online hybrid distillation
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_layers: int = 0  # LoRA on the last n drafter layers (0 = all)
    lr: float = 1e-3
    kd_weight: float = 1.0
    ngram_weight: float = 1.0
    kd_target: str = "intersection"  # [I] "intersection" or "first_token"
    ngram_loss: str = "nll"  # [I] "nll" (−log ∏q) or "weighted_nll" (× the target's p of the token)
    train_window: int = 256  # drafter tokens per distillation step (the most recent)
    # (d) adaptive draft length
    head_threshold: float = 0.3
    head_rule: str = "token"  # [I] "token" or "cumulative"
    head_features: str = "hidden+conf"  # [I] "hidden" or "hidden+conf"
    head_lr: float = 1e-2
    head_steps: int = 2
    head_buffer: int = 512
    # exactness check of speculative sampling (toy world, see checks.py): draws per variant, 0 = off
    dist_samples: int = 20000


CHOICES = {"target": {"tiny", "smollm2"}, "dtype": {"float32", "float64"}, "mode": {"greedy", "sample"},
           "kd_target": {"intersection", "first_token"}, "ngram_loss": {"nll", "weighted_nll"},
           "head_rule": {"token", "cumulative"}, "head_features": {"hidden", "hidden+conf"}}


def check(p: OmniDraftParams) -> None:
    """One-line ConfigErrors for bad values (before any MLflow run)."""
    for key, allowed in CHOICES.items():
        if getattr(p, key) not in allowed:
            raise ConfigError(f"params.{key} must be one of {sorted(allowed)}, got {getattr(p, key)!r}")
    if not p.variants or set(p.variants) - set(VARIANTS) or len(set(p.variants)) != len(p.variants):
        raise ConfigError(f"params.variants must be distinct letters from 'abcd', got {p.variants!r}")
    for key in ("target_preset", "drafter_preset"):
        if getattr(p, key) not in tiny.PRESETS:
            raise ConfigError(f"params.{key} must be one of {sorted(tiny.PRESETS)}, got {getattr(p, key)!r}")
    for key in ("target_vocab", "drafter_vocab"):
        if getattr(p, key) != 0 and getattr(p, key) < 300:
            raise ConfigError(f"params.{key} must be 0 (the preset's) or >= 300, got {getattr(p, key)}")
    positive = ("threads", "prompts", "prompt_tokens", "new_tokens", "k", "lora_rank", "train_window", "head_steps",
                "head_buffer")
    for key in positive:
        if getattr(p, key) < 1:
            raise ConfigError(f"params.{key} must be >= 1, got {getattr(p, key)}")
    for key in ("temperature", "lr", "head_lr", "lora_alpha"):
        if not getattr(p, key) > 0:
            raise ConfigError(f"params.{key} must be > 0, got {getattr(p, key)}")
    for key in ("kd_weight", "ngram_weight", "dist_samples", "lora_layers"):
        if getattr(p, key) < 0:
            raise ConfigError(f"params.{key} must be >= 0, got {getattr(p, key)}")
    if p.ngram_max < 2:
        raise ConfigError(f"params.ngram_max must be >= 2, got {p.ngram_max}")
    if p.drafter_window and p.drafter_window < 2 * (p.k + 4):
        raise ConfigError(f"params.drafter_window must be 0 or >= 2 * (k + 4) = {2 * (p.k + 4)}, got {p.drafter_window}")
    if not 0 < p.head_threshold < 1:
        raise ConfigError(f"params.head_threshold must be in (0, 1), got {p.head_threshold}")
    if p.target == "tiny" and _spec(p.target_preset, p.target_vocab).vocab_size == _spec(p.drafter_preset, p.drafter_vocab).vocab_size:
        raise ConfigError("the drafter needs a vocabulary different from the target's: "
                          "set params.target_vocab or params.drafter_vocab")
    if p.target == "tiny" and p.prompt_tokens + p.new_tokens > _spec(p.target_preset, p.target_vocab).max_len:
        raise ConfigError(f"params.prompt_tokens + params.new_tokens must be <= the target's max_len "
                          f"({_spec(p.target_preset, p.target_vocab).max_len})")


def _spec(preset: str, vocab: int) -> tiny.TinyLMSpec:
    return tiny.preset(preset, **({"vocab_size": vocab} if vocab else {}))


# -- models and prompts ----------------------------------------------------------------------------------


@dataclass
class Models:
    target: torch.nn.Module
    target_tok: Any
    drafter: torch.nn.Module
    drafter_tok: Any
    eos: set[int]
    cards: list[dict[str, Any]]


def load_models(p: OmniDraftParams, progress: bool | None = None) -> Models:
    dtype = torch.float64 if p.dtype == "float64" else torch.float32
    d_spec = _spec(p.drafter_preset, p.drafter_vocab)
    drafter, d_card = tiny.load_or_train(d_spec, progress=progress, name=f"omnidraft drafter tiny/{p.drafter_preset}")
    cards = [{"role": "drafter", "model": f"tiny/{p.drafter_preset}", "vocab": d_spec.vocab_size,
              "parameters": d_card["parameters"], "heldout_loss": round(d_card["heldout_loss"], 4)}]
    if p.target == "smollm2":
        from central.lm.smollm import load_smollm2

        target, target_tok = load_smollm2()
        target = copy.deepcopy(target)
        eos = {int(target_tok.eos_token_id)} if target_tok.eos_token_id is not None else set()
        cards.insert(0, {"role": "target", "model": "SmolLM2-135M-Instruct", "vocab": len(target_tok),
                         "parameters": sum(x.numel() for x in target.parameters()), "heldout_loss": float("nan")})
    else:
        t_spec = _spec(p.target_preset, p.target_vocab)
        target, t_card = tiny.load_or_train(t_spec, progress=progress, name=f"omnidraft target tiny/{p.target_preset}")
        target_tok = tiny.tokenizer_for(t_spec)
        eos = set(special_tokens(target_tok).values())
        cards.insert(0, {"role": "target", "model": f"tiny/{p.target_preset}", "vocab": t_spec.vocab_size,
                         "parameters": t_card["parameters"], "heldout_loss": round(t_card["heldout_loss"], 4)})
    return Models(target.to(dtype).eval(), target_tok, drafter.to(dtype).eval(), tiny.tokenizer_for(d_spec), eos, cards)


def stream_prompts(target_tok: Any, n: int, prompt_tokens: int, new_tokens: int,
                   rng: np.random.Generator | None = None) -> list[tuple[str, list[int]]]:
    """The first ``prompt_tokens`` target tokens of the first ``n`` held-out files long enough.

    Files come sorted by path, or in the order of a permutation drawn from ``rng``.
    """
    files = list(load_corpus().heldout_files)
    if rng is not None:
        files = [files[i] for i in rng.permutation(len(files))]
    out = []
    for path in files:
        ids = backend(target_tok).encode(read_source(path)[:20_000]).ids
        if len(ids) >= prompt_tokens + new_tokens:
            out.append((path.name, ids[:prompt_tokens]))
        if len(out) == n:
            return out
    raise ConfigError(f"only {len(out)} held-out files have {prompt_tokens + new_tokens} tokens; lower params.prompts")


def build_decoder(letter: str, m: Models, bridge: VocabBridge, p: OmniDraftParams, ctx: CentralContext) -> SpecDecoder:
    variant = VARIANTS[letter]
    cfg = DecodeConfig(k=p.k, greedy=p.mode == "greedy", temperature=p.temperature, head_threshold=p.head_threshold,
                       head_rule=p.head_rule, cache_prompt=p.cache_prompt, drafter_window=p.drafter_window,
                       lean=p.lean_forward)
    drafter = copy.deepcopy(m.drafter) if variant.distill else m.drafter
    distiller = head = None
    if variant.distill:
        distiller = OnlineDistiller(drafter, bridge, rank=p.lora_rank, alpha=p.lora_alpha, last_layers=p.lora_layers,
                                    lr=p.lr, window=p.train_window, kd_weight=p.kd_weight, ngram_weight=p.ngram_weight,
                                    kd_target=p.kd_target, ngram_loss=p.ngram_loss, temperature=p.temperature,
                                    gen=ctx.generator("lora", letter))
    if variant.head:
        torch.manual_seed(ctx.seed("head", letter))
        head = AcceptanceHead(drafter.config.hidden_size, p.head_features, p.head_lr, p.head_steps, p.head_buffer,
                              next(drafter.parameters()).dtype)
    return SpecDecoder(variant, m.target, drafter, bridge, cfg, m.eos, ngram_max=p.ngram_max, distiller=distiller,
                       head=head)


# -- the run ---------------------------------------------------------------------------------------------


@CENTRAL.register("omnidraft", params=OmniDraftParams,
                  summary="OmniDraft: cross-vocabulary speculative decoding with an online n-gram cache, "
                          "online LoRA distillation and an adaptive draft length (arXiv 2507.02659)")
def run_omnidraft(ctx: CentralContext) -> dict[str, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(ctx.params.threads)
    try:
        return _run(ctx)
    finally:
        torch.set_num_threads(threads)


def _run(ctx: CentralContext) -> dict[str, float]:
    p: OmniDraftParams = ctx.params
    torch.manual_seed(ctx.seed("torch"))
    m = load_models(p, ctx.show_progress)
    bridge = VocabBridge(m.drafter_tok, m.target_tok)
    prompts = stream_prompts(m.target_tok, p.prompts, p.prompt_tokens, p.new_tokens,
                             ctx.rng("stream") if p.shuffle_stream else None)
    decoders = {v: build_decoder(v, m, bridge, p, ctx) for v in p.variants}
    baseline = CachedLM(m.target, p.lean_forward)  # target-only decoding runs the same forward as the verifier
    greedy = p.mode == "greedy"
    rows: list[dict[str, Any]] = []
    outputs: dict[str, list[list[int]]] = {v: [] for v in p.variants}
    reference: list[list[int]] = []
    base_seconds: list[float] = []
    totals = {v: Stats() for v in p.variants}
    with ctx.progress(len(prompts), "omnidraft stream") as bar:
        for i, (name, prompt) in enumerate(prompts):
            text = bridge.target_text(prompt).decode("utf-8", errors="replace")
            ref, seconds, _ = target_only(baseline, prompt, p.new_tokens, greedy=greedy, temperature=p.temperature,
                                          eos=m.eos, gen=ctx.generator("sample", "target", i))
            reference.append(ref)
            base_seconds.append(seconds)
            step: dict[str, float] = {}
            for v, dec in decoders.items():
                out, s = dec.generate(prompt, text, p.new_tokens, ctx.generator("sample", v, i))
                outputs[v].append(out)
                _add(totals[v], s)
                row = _row(i, name, v, s, seconds, out == ref if greedy else None)
                rows.append(row)
                step[f"stream/accepted_per_call/{v}"] = row["accepted_per_call"]
                step[f"accepted_per_call/{v}"] = totals[v].accepted / max(1, totals[v].target_calls)
            step["accepted_per_call"] = step[f"accepted_per_call/{p.variants[-1]}"]
            ctx.log_metrics(step, step=i + 1)
            bar.advance()
    dist = _dist_checks(p, ctx)
    base = Baseline(sum(base_seconds), baseline.seconds, baseline.calls)
    summary = [_summary(v, totals[v], base, rows, greedy_identical(outputs[v], reference) if greedy
                        else float("nan"), [r for r in dist if r["sampler"] == "exact" and r["variant"] == v],
                        decoders[v]) for v in p.variants]
    _log_outputs(ctx, p, m, bridge, rows, summary, dist, decoders)
    ctx.log_table(time_split_rows(summary, base), "time_split")
    ctx.log_figure(_plot_time_split(summary, base), "where_the_time_goes")
    out = _headline(summary, p.variants[-1], reference, base_seconds)
    control = [r["chi2_pvalue"] for r in dist if r["sampler"] != "exact"]
    if control:
        out["exact_control_pvalue"] = float(min(control))
    return out


def _add(total: Stats, s: Stats) -> None:
    for key, value in vars(s).items():
        setattr(total, key, getattr(total, key) + value)


def _row(i: int, name: str, v: str, s: Stats, base_seconds: float, identical: bool | None) -> dict[str, Any]:
    calls = max(1, s.target_calls)
    return {"prompt": i, "file": name, "variant": v, "generated": s.generated, "target_calls": s.target_calls,
            "accepted_per_call": s.accepted / calls, "tokens_per_call": s.generated / calls,
            "calls_per_char": s.target_calls / max(1, s.chars), "draft_tokens": s.draft_tokens, "wasted": s.wasted,
            "merged_accepted": s.merged_accepted, "decode_s": s.decode_seconds, "train_s": s.train_seconds,
            "target_only_s": base_seconds, "identical": "" if identical is None else identical}


def _dist_checks(p: OmniDraftParams, ctx: CentralContext) -> list[dict[str, Any]]:
    """The powered exactness check of the sampler's code (toy world; :func:`exactness_check`)."""
    if p.dist_samples < 1:
        return []
    return exactness_check(p.dist_samples, seed=int(ctx.seed("dist")) % 2**31, variants=p.variants, k=p.k)


@dataclass(frozen=True)
class Baseline:
    """Target-only decoding of the same prompts: total seconds, the part inside the forward, forwards."""

    seconds: float
    forward_seconds: float
    calls: int

    @property
    def per_call(self) -> float:
        return self.forward_seconds / max(1, self.calls)


def profile(t: Stats, base: Baseline) -> dict[str, float]:
    """Where one variant's decoding time goes, and what the drafter would have to cost to break even.

    Shares split ``decode_seconds`` into the target's forwards, the drafter's (its re-encodings of a
    cache dropped after a distillation step counted apart) and the rest (Python: translation, n-gram
    look-ups, verification, bookkeeping).  ``drafter_cost_ratio`` is one drafter forward over one
    target-only forward; ``breakeven_cost_ratio`` is the ratio at which the speed-up would be 1 with
    everything else as measured (<= 0: even a free drafter loses); ``speedup_free_drafter`` is the
    speed-up with drafting free.
    """
    decode = max(1e-9, t.decode_seconds)
    python = decode - t.target_forward_seconds - t.drafter_forward_seconds
    drafter_ms = t.drafter_forward_seconds / max(1, t.drafter_calls)
    without_drafter = decode - t.drafter_forward_seconds
    return {"target_ms_per_call": 1e3 * t.target_forward_seconds / max(1, t.target_calls),
            "drafter_ms_per_call": 1e3 * drafter_ms, "baseline_ms_per_call": 1e3 * base.per_call,
            "drafter_calls_per_target_call": t.drafter_calls / max(1, t.target_calls),
            "share_target": t.target_forward_seconds / decode,
            "share_drafter": (t.drafter_forward_seconds - t.drafter_rebuild_seconds) / decode,
            "share_drafter_rebuild": t.drafter_rebuild_seconds / decode, "share_python": python / decode,
            "drafter_cost_ratio": drafter_ms / max(1e-12, base.per_call),
            "breakeven_cost_ratio": (base.seconds - without_drafter) / max(1, t.drafter_calls) / max(1e-12, base.per_call),
            "speedup_free_drafter": base.seconds / max(1e-9, without_drafter)}


PROFILE_HEADLINE = ("drafter_cost_ratio", "breakeven_cost_ratio", "speedup_free_drafter", "share_target",
                    "share_drafter", "share_drafter_rebuild", "share_python")


def time_split_rows(summary: list[dict[str, Any]], base: Baseline) -> list[dict[str, Any]]:
    """One row per variant and one for target-only decoding: seconds by where they went."""
    rows = [{"decoder": "target only", "seconds": round(base.seconds, 3), "target_forward": round(base.forward_seconds, 3),
             "drafter_forward": 0.0, "drafter_rebuild": 0.0, "python": round(base.seconds - base.forward_seconds, 3),
             "target_calls": base.calls, "ms_per_target_call": round(1e3 * base.per_call, 3), "speedup": 1.0}]
    for s in summary:
        d = s["decode_seconds"]
        rows.append({"decoder": f"({s['variant']})", "seconds": round(d, 3),
                     "target_forward": round(d * s["share_target"], 3),
                     "drafter_forward": round(d * s["share_drafter"], 3),
                     "drafter_rebuild": round(d * s["share_drafter_rebuild"], 3),
                     "python": round(d * s["share_python"], 3), "target_calls": s["target_calls"],
                     "ms_per_target_call": round(s["target_ms_per_call"], 3), "speedup": round(s["speedup"], 3)})
    return rows


def _summary(v: str, t: Stats, base: Baseline, rows: list[dict[str, Any]], identical: float,
             dist: list[dict[str, Any]], dec: SpecDecoder) -> dict[str, Any]:
    base_seconds = base.seconds
    per_prompt = np.array([r["accepted_per_call"] for r in rows if r["variant"] == v])
    b_rows = np.array([r["accepted_per_call"] for r in rows if r["variant"] == "b"])
    calls = max(1, t.target_calls)
    return {"variant": v, "accepted_per_call": t.accepted / calls, "tokens_per_call": t.generated / calls,
            "calls_per_char": t.target_calls / max(1, t.chars),
            "acceptance_rate": t.accepted / max(1, t.proposals),
            "wasted_per_token": t.wasted / max(1, t.generated), "wasted_fraction": t.wasted / max(1, t.draft_tokens),
            "draft_tokens_per_call": t.draft_tokens / calls, "merged_accepted_per_call": t.merged_accepted / calls,
            "acceptance_rise": _rise(per_prompt),
            "rise_vs_b": _rise(per_prompt - b_rows) if len(b_rows) == len(per_prompt) and v in "cd" else float("nan"),
            "head_auc": _auc(dec.head_log),
            "speedup": base_seconds / max(1e-9, t.decode_seconds),
            "speedup_end_to_end": base_seconds / max(1e-9, t.decode_seconds + t.train_seconds),
            "greedy_identical": identical,
            "exact_pvalue": min(r["chi2_pvalue"] for r in dist) if dist else float("nan"),
            "exact_tv": max(r["tv"] for r in dist if "," not in r["position"]) if dist else float("nan"),
            "ngram_entries": len(dec.cache) if dec.cache else 0,
            "head_stops": t.head_stops, "target_calls": t.target_calls, "generated": t.generated,
            "decode_seconds": t.decode_seconds, **profile(t, base)}


def _rise(per_prompt: np.ndarray) -> float:
    """Mean over the last third of the stream minus mean over the first third."""
    third = max(1, len(per_prompt) // 3)
    return float(per_prompt[-third:].mean() - per_prompt[:third].mean())


def _auc(log: list[tuple[float, float]]) -> float:
    """ROC AUC of the head's predictions against accepted (label >= 0.5) / rejected."""
    if not log:
        return float("nan")
    from scipy.stats import rankdata

    pred, label = np.array(log).T
    positive = label >= 0.5
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if not n_pos or not n_neg:
        return float("nan")
    return float((rankdata(pred)[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


HEADLINE_KEYS = ("accepted_per_call", "tokens_per_call", "calls_per_char", "wasted_per_token", "acceptance_rise",
                 "rise_vs_b", "head_auc", "speedup", "speedup_end_to_end", "greedy_identical", "exact_pvalue",
                 "exact_tv")


def _headline(summary: list[dict[str, Any]], last: str, reference: list[list[int]], base_seconds: list[float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in summary:
        for key in HEADLINE_KEYS:
            if not (isinstance(s[key], float) and math.isnan(s[key])):
                out[f"{key}/{s['variant']}"] = float(s[key])
                if s["variant"] == last:
                    out[key] = float(s[key])
        for key in PROFILE_HEADLINE:  # timings: they differ run to run (before_after.py leaves timing/ out)
            out[f"timing/{key}/{s['variant']}"] = float(s[key])
    out["target_only/tokens_per_second"] = sum(len(r) for r in reference) / max(1e-9, sum(base_seconds))
    return out


# -- tables and plots ------------------------------------------------------------------------------------


def _log_outputs(ctx: CentralContext, p: OmniDraftParams, m: Models, bridge: VocabBridge, rows: list[dict[str, Any]],
                 summary: list[dict[str, Any]], dist: list[dict[str, Any]], decoders: dict[str, SpecDecoder]) -> None:
    ctx.log_table(m.cards + [{"role": "bridge", "model": "intersection", "vocab": bridge.intersection()}], "models")
    ctx.log_table(summary, "variants")
    ctx.log_table(rows, "stream")
    ctx.log_table(dist, "sampling_exactness")
    ctx.log_table(_cache_rows(decoders, bridge), "ngram_cache")
    ctx.log_figure(_plot_stream(rows, p.variants), "acceptance_over_stream")
    ctx.log_figure(_plot_bars(summary), "speedup_and_waste")


def _cache_rows(decoders: dict[str, SpecDecoder], bridge: VocabBridge, top: int = 20) -> list[dict[str, Any]]:
    for v in reversed(list(decoders)):
        cache = decoders[v].cache
        if cache is None:
            continue
        best = sorted(cache.entries.items(), key=lambda kv: -cache.hits.get(kv[0], 0))[:top]
        return [{"variant": v, "target_token": repr(bridge.target_text([t]).decode("utf-8", "replace")),
                 "draft_run": " + ".join(repr((bridge.draft_bytes[d] or b"").decode("utf-8", "replace")) for d in run),
                 "accepted_merges": cache.hits.get(run, 0)} for run, t in best]
    return []


def _plot_stream(rows: list[dict[str, Any]], variants: str) -> Any:
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for v in variants:
        y = np.array([r["accepted_per_call"] for r in rows if r["variant"] == v])
        x = np.arange(1, len(y) + 1)
        line, = ax.plot(x, y, alpha=0.35, lw=1)
        w = max(1, min(5, len(y) // 3))
        smooth = np.convolve(y, np.ones(w) / w, mode="valid")
        ax.plot(x[w - 1 :], smooth, color=line.get_color(), lw=2, label=f"({v}) {_LABELS[v]}")
    ax.set_xlabel("prompt in the stream")
    ax.set_ylabel("accepted target tokens per target call")
    ax.set_title("OmniDraft: acceptance over the stream (thin: per prompt, thick: moving mean)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _plot_bars(summary: list[dict[str, Any]]) -> Any:
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    names = [f"({s['variant']})" for s in summary]
    x = np.arange(len(summary))
    axes[0].bar(x - 0.2, [s["speedup"] for s in summary], 0.4, label="decoding only")
    axes[0].bar(x + 0.2, [s["speedup_end_to_end"] for s in summary], 0.4, label="incl. online training")
    axes[0].axhline(1.0, color="k", lw=1, ls="--")
    axes[0].set_title("wall-clock speed-up vs target-only")
    axes[0].legend(fontsize=8)
    axes[1].bar(x, [s["accepted_per_call"] for s in summary])
    axes[1].set_title("accepted tokens per target call")
    axes[2].bar(x, [s["wasted_per_token"] for s in summary])
    axes[2].set_title("wasted draft tokens per generated token")
    for ax in axes:
        ax.set_xticks(x, names)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def _plot_time_split(summary: list[dict[str, Any]], base: Baseline) -> Any:
    """Stacked seconds per decoder: target forwards, drafter forwards, drafter re-encodings, Python."""
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    rows = time_split_rows(summary, base)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for key, label in (("target_forward", "target forwards"), ("drafter_forward", "drafter forwards"),
                       ("drafter_rebuild", "drafter re-encoding (cache dropped)"), ("python", "Python (translation, verification, ...)")):
        values = np.array([r[key] for r in rows], dtype=float)
        ax.bar(x, values, 0.6, bottom=bottom, label=label)
        bottom += values
    for xi, r in zip(x, rows):
        ax.text(xi, bottom[xi], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [r["decoder"] for r in rows])
    ax.set_ylabel("seconds (decoding only)")
    ax.set_title("where the decoding time goes (labels: speed-up vs target-only)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


_LABELS = {"a": "intersection only", "b": "+ n-gram cache", "c": "+ online distillation", "d": "+ adaptive length"}

run_omnidraft.check = check  # type: ignore[attr-defined]

__all__ = ["OmniDraftParams", "run_omnidraft", "check", "load_models", "stream_prompts", "build_decoder"]
