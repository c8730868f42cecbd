"""Tiny causal LMs trained from scratch on the stdlib corpus, cached on disk.

The architecture is transformers' ``LlamaForCausalLM`` (RMSNorm, rotary positions, SwiGLU), i.e. the
same family as SmolLM2, so code written against one (KV caches, attention hooks, ``generate``) runs
on the other.  A model is defined by a :class:`TinyLMSpec` (architecture *and* training recipe);
the trained weights are cached as safetensors under ``<cache>/tinylm/<hash>.safetensors`` with a
JSON card (train/held-out loss, parameter count, seconds), so a spec trains once per machine.

Presets: ``target`` (~4.2M parameters, 4096-token BPE; tens of minutes on 2 busy CPU cores), ``drafter``
(~0.27M parameters, 512-token BPE: a *different* vocabulary) and ``test`` (seconds, for tests).

A cold cache is never silent: :func:`load_or_train` logs one line (what it trains, why — the missing
cache file — and a time estimate from one timed probe step) and shows a progress bar with steps
done/total, the loss, elapsed time and an ETA (``progress=``: a ``ctx.progress``-style factory, ``True``
for the built-in rich bar, ``False`` for none; by default the bar shows when stderr is a terminal).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, ContextManager, Union

import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from central.lm.cache import atomic_write_bytes, cache_dir, key_of
from central.lm.corpus import load_corpus
from central.lm.tokenizer import encode, train_bpe


log = logging.getLogger("fedsim.lm")

#: ``(total, description) -> context manager with .advance(n=1)`` (``CentralContext.progress`` fits).
ProgressFactory = Callable[[int, str], ContextManager[Any]]


@dataclass(frozen=True)
class TinyLMSpec:
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 688
    max_len: int = 512
    # training recipe
    steps: int = 1200
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 100
    corpus_chars: int = 3_000_000
    seed: int = 0


PRESETS: dict[str, TinyLMSpec] = {
    "target": TinyLMSpec(),
    "drafter": TinyLMSpec(vocab_size=512, d_model=96, n_layers=2, n_heads=4, d_ff=256, steps=800, lr=4e-3),
    "test": TinyLMSpec(vocab_size=512, d_model=48, n_layers=2, n_heads=2, d_ff=96, max_len=256, steps=40,
                       batch_size=8, seq_len=64, warmup=5, corpus_chars=300_000),
}


def preset(name: str, **changes: object) -> TinyLMSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown tiny-LM preset {name!r}; known: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **changes)  # type: ignore[arg-type]


def build(spec: TinyLMSpec) -> LlamaForCausalLM:
    """An untrained model of ``spec`` (seeded init)."""
    config = LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.d_model, intermediate_size=spec.d_ff,
                         num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads,
                         num_key_value_heads=spec.n_heads, max_position_embeddings=spec.max_len,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._attn_implementation = "eager"  # plain attention: hookable, and what LRQK replaces
    torch.manual_seed(spec.seed)
    return LlamaForCausalLM(config)


def tokenizer_for(spec: TinyLMSpec) -> Tokenizer:
    return train_bpe(spec.vocab_size)


def corpus_ids(tok: Tokenizer, split: str, max_chars: int) -> torch.Tensor:
    """The train or held-out corpus text as one 1-D tensor of token ids."""
    corpus = load_corpus()
    text = corpus.train_text(max_chars) if split == "train" else corpus.heldout_text(max_chars)
    return torch.tensor(encode(tok, text), dtype=torch.long)


def _windows(ids: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, ids: torch.Tensor, seq_len: int = 128, max_windows: int = 32) -> float:
    """Mean next-token cross-entropy over consecutive windows of ``ids``."""
    model.eval()
    n = min(max_windows, (len(ids) - 1) // seq_len)
    if n < 1:
        raise ValueError("too few tokens to evaluate")
    x = ids[: n * seq_len + 1]
    batch = torch.stack([x[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])
    out = model(input_ids=batch[:, :-1], use_cache=False)
    logits = out.logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)))


@dataclass(frozen=True)
class Recipe:
    """An AdamW recipe: linear warm-up over ``warmup`` steps, then cosine decay to ``final_lr_ratio``·lr."""

    lr: float
    warmup: int = 0
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    final_lr_ratio: float = 0.1

    def lr_factor(self, step: int, steps: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, steps - self.warmup)
        return self.final_lr_ratio + (1 - self.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def pretrain_recipe(spec: TinyLMSpec) -> Recipe:
    """The kit's pre-training recipe for ``spec``: AdamW(0.9, 0.95), wd 0.1, warm-up, cosine to 10%."""
    return Recipe(spec.lr, spec.warmup, 0.1, (0.9, 0.95), 0.1)


def train_steps(model: LlamaForCausalLM, ids: torch.Tensor, recipe: Recipe, steps: int, batch_size: int,
                seq_len: int, gen: torch.Generator, param_groups: list[dict] | None = None,
                on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """``steps`` AdamW steps of next-token loss on random windows of ``ids`` (grad-norm clip 1.0).

    ``param_groups`` (default: every parameter at the recipe's weight decay) lets a caller exempt
    some parameters from weight decay.  Returns the training loss per step; leaves the model in eval mode.
    """
    groups = param_groups if param_groups is not None else [{"params": list(model.parameters())}]
    opt = torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: recipe.lr_factor(step, steps))
    model.train()
    losses = []
    for step in range(steps):
        batch = _windows(ids, batch_size, seq_len, gen)
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


def train(model: LlamaForCausalLM, spec: TinyLMSpec, ids: torch.Tensor,
          on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Pre-train ``model`` with ``spec``'s recipe (:func:`pretrain_recipe`); returns the loss per step."""
    gen = torch.Generator().manual_seed(spec.seed + 1)
    return train_steps(model, ids, pretrain_recipe(spec), spec.steps, spec.batch_size, spec.seq_len, gen,
                       on_step=on_step)


class _RichBar:
    """A rich bar on stderr: steps done/total, loss, elapsed and remaining time (the ETA)."""

    def __init__(self, total: int, description: str) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[loss]}"), TimeElapsedColumn(), TextColumn("ETA"),
                             TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        self._task = self._bar.add_task(description, total=total, loss="")

    def __enter__(self) -> "_RichBar":
        self._bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.stop()

    def advance(self, n: int = 1, loss: float | None = None) -> None:
        self._bar.update(self._task, advance=n, **({"loss": f"loss {loss:.3f}"} if loss is not None else {}))


def _progress_factory(progress: Union[bool, ProgressFactory, None]) -> ProgressFactory | None:
    if progress is None:
        progress = sys.stderr.isatty()
    if progress is True:
        return _RichBar
    return progress or None


def _seconds_per_step(model: LlamaForCausalLM, ids: torch.Tensor, spec: TinyLMSpec) -> float:
    """Time one forward/backward at the training shape (own generator, gradients dropped: no side effects)."""
    batch = _windows(ids, spec.batch_size, spec.seq_len, torch.Generator().manual_seed(spec.seed + 2))
    start = time.perf_counter()
    model.train()
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)).backward()
    elapsed = time.perf_counter() - start
    for param in model.parameters():
        param.grad = None
    model.eval()
    return elapsed * 1.15  # + the optimiser step and clipping


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def load_or_train(spec: TinyLMSpec, on_step: Callable[[int, float], None] | None = None,
                  progress: Union[bool, ProgressFactory, None] = None,
                  name: str = "tiny LM") -> tuple[LlamaForCausalLM, dict]:
    """The trained model of ``spec`` (from the cache, or trained now and cached) and its card.

    On a cold cache it logs one line (what is trained, the missing cache path, an estimate of the time)
    and reports every step to ``progress`` (see the module docstring); a warm cache does neither.
    """
    from safetensors.torch import load_file, save_file

    tok = tokenizer_for(spec)
    key = key_of(asdict(spec), load_corpus().python_version)
    weights = cache_dir() / "tinylm" / f"{key}.safetensors"
    card_path = weights.with_suffix(".json")
    model = build(spec)
    if weights.is_file() and card_path.is_file():
        model.load_state_dict(load_file(str(weights)), strict=False)  # tied lm_head is not stored twice
        model.eval()
        return model, json.loads(card_path.read_text())
    ids = corpus_ids(tok, "train", spec.corpus_chars)
    n_params = sum(p.numel() for p in model.parameters())
    estimate = _seconds_per_step(model, ids, spec) * spec.steps
    log.warning("%s: pre-training %.2fM parameters for %d steps (not in the cache: %s missing); "
                "about %s on this machine, once — later runs load it", name, n_params / 1e6, spec.steps,
                weights, _duration(estimate))
    factory = _progress_factory(progress)
    start = time.perf_counter()
    with factory(spec.steps, f"pre-training {name}") if factory else contextlib.nullcontext() as bar:
        def step(i: int, loss: float) -> None:
            if bar is not None:
                if isinstance(bar, _RichBar):
                    bar.advance(1, loss)
                else:
                    bar.advance(1)
            if on_step is not None:
                on_step(i, loss)

        losses = train(model, spec, ids, step)
    held = mean_loss(model, corpus_ids(tok, "heldout", 200_000), spec.seq_len)
    card = {"spec": asdict(spec), "parameters": n_params,
            "train_loss_last50": sum(losses[-50:]) / len(losses[-50:]), "heldout_loss": held,
            "train_seconds": time.perf_counter() - start}
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tmp = weights.with_suffix(f".tmp{id(model)}")
    weights.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp))
    tmp.replace(weights)
    atomic_write_bytes(card_path, json.dumps(card, indent=1).encode())
    log.warning("%s: pre-trained in %s, cached at %s", name, _duration(card["train_seconds"]), weights)
    return model, card
