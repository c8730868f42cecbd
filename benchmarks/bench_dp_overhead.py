"""DP-SGD overhead: time per DP-SGD step / time per non-private step, per Opacus per-sample-gradient mode.

Measured in one run on the same batches:

* the default FedSVD model (MiniLM-L6 + LoRA r=8 on query/value, A frozen as in FedSVD, head
  trainable as in experiments/fedsvd.yaml), logical batch 64 × 32 tokens;
* the small CNN on MNIST with every parameter private (full-model DP-SGD), batch 64.

A step is forward + backward + optimizer step on one logical batch (no physical splitting).  The
DP step includes per-sample gradients, clipping and noise.  Prints the median step time over
``--steps`` steps after ``--warmup`` steps and the ratio to the non-private step.

    python benchmarks/bench_dp_overhead.py            # both models, all modes
    python benchmarks/bench_dp_overhead.py --quick    # fewer steps
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envs.datasets import load_mnist  # noqa: E402
from envs.text import StdlibDocsParams, load_stdlib_docs  # noqa: E402
from fedsim.models import build_model  # noqa: E402

MODES = ["hooks", "ew", "functorch", "ghost"]


def time_steps(step: Callable[[int], None], warmup: int, steps: int) -> float:
    for i in range(warmup):
        step(i)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(warmup + i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plain_step_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> Callable[[int], None]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)

    def step(i: int) -> None:
        idx = torch.arange(i * batch, (i + 1) * batch) % len(y)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()

    return step


def dp_step_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, mode: str) -> Callable[[int], None]:
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch)
    engine = PrivacyEngine(accountant="prv")
    kwargs = dict(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                  poisson_sampling=False, grad_sample_mode=mode)
    if mode == "ghost":
        module, dp_opt, criterion, _ = engine.make_private(criterion=nn.CrossEntropyLoss(), **kwargs)
    else:
        module, dp_opt, _ = engine.make_private(**kwargs)
        criterion = nn.CrossEntropyLoss()

    def step(i: int) -> None:
        idx = torch.arange(i * batch, (i + 1) * batch) % len(y)
        dp_opt.zero_grad(set_to_none=True)
        criterion(module(x[idx]), y[idx]).backward()
        dp_opt.step()

    return step


def bench(name: str, make_model: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, batch: int,
          warmup: int, steps: int) -> list[tuple[str, float, float]]:
    base = time_steps(plain_step_fn(make_model(), x, y, batch), warmup, steps)
    rows = [("non-private", base, 1.0)]
    for mode in MODES:
        try:
            t = time_steps(dp_step_fn(make_model(), x, y, batch, mode), warmup, steps)
            rows.append((mode, t, t / base))
        except Exception as exc:  # a mode Opacus cannot apply to this model
            rows.append((f"{mode} (failed: {type(exc).__name__})", float("nan"), float("nan")))
    print(f"\n{name}: batch {batch}, median of {steps} steps after {warmup} warm-up")
    print(f"{'mode':<34}{'step (ms)':>12}{'ratio':>10}")
    for mode, t, r in rows:
        print(f"{mode:<34}{t * 1e3:>12.1f}{r:>9.2f}x")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--only", choices=["minilm", "cnn"], default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warmup, steps = (1, 3) if args.quick else (2, 8)
    print(f"torch {torch.__version__}, {args.threads} threads")
    if args.only in (None, "minilm"):
        text = load_stdlib_docs(StdlibDocsParams(max_len=32), seed=0)
        xt, yt = text.to_tensors()

        def minilm() -> nn.Module:
            m = build_model("minilm_lora", {"train_head": True}, text.input_shape, text.num_classes)
            m.set_trainable(A=False, B=True, head=True)
            return m.train()

        bench("MiniLM-L6 + LoRA (B and head trainable), 32 tokens", minilm, xt, yt, 64, warmup, steps)
    if args.only in (None, "cnn"):
        mnist = load_mnist(None, seed=0)
        xm, ym = mnist.to_tensors()
        cnn = lambda: build_model("cnn", {}, mnist.input_shape, mnist.num_classes).train()  # noqa: E731
        bench("small CNN on MNIST (all parameters private)", cnn, xm, ym, 64, warmup * 3, steps * 3)


if __name__ == "__main__":
    main()
