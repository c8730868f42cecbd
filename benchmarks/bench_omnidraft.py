"""Benchmark: OmniDraft's decoding speed with transformers' forward vs the lean forward (issue #26).

Run ``python benchmarks/bench_omnidraft.py [--prompts 6] [--target tiny|smollm2] [--repeats 2]``.

Part 1 times one KV-cached single-token forward of each model (drafter and target) through
transformers (``CachedLM(lean=False)``) and through :mod:`central.lm.lean`, interleaved, best of
``--repeats`` rounds of 50 forwards, and prints the ratios that decide speculative decoding: the
drafter's cost as a fraction of the target's on each path.  Part 2 runs the same OmniDraft stream
(greedy, all four variants) with ``params.lean_forward`` false and true, interleaved, and prints per
variant the accepted tokens per call (equal on both paths: the same function), the wall-clock
speed-up against target-only decoding on the same path, and where the time went.

Timings need a quiet machine: on a loaded 2-core VM they swing by tens of percent.  One torch
thread (the method's default).  The tiny LMs must be cached (any ``fedsim run omnidraft`` trains
them once).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from central.omnidraft.decode import CachedLM  # noqa: E402
from central.omnidraft.method import OmniDraftParams, load_models  # noqa: E402
from fedsim import config as C  # noqa: E402
from fedsim.central_runner import run_central  # noqa: E402


def forward_ms(model: torch.nn.Module, lean: bool, context: int = 64, steps: int = 50) -> float:
    """Milliseconds per single-token KV-cached forward after a ``context``-token prefill."""
    lm = CachedLM(model, lean=lean)
    lm.set_ids(list(range(3, 3 + context)))
    lm.forward()
    start = time.perf_counter()
    for _ in range(steps):
        lm.append(7)
        lm.forward()
    return 1e3 * (time.perf_counter() - start) / steps


def part1(params: OmniDraftParams, repeats: int, console: Console) -> None:
    m = load_models(params)
    best: dict[tuple[str, bool], float] = {}
    for _ in range(repeats):
        for name, model in (("drafter", m.drafter), ("target", m.target)):
            for lean in (False, True):
                ms = forward_ms(model, lean)
                best[(name, lean)] = min(ms, best.get((name, lean), float("inf")))
    table = Table(title=f"one KV-cached token forward, ms (best of {repeats}); target = {params.target}")
    for col in ("model", "transformers", "lean", "lean speed-up"):
        table.add_column(col, justify="right")
    for name in ("drafter", "target"):
        hf, lean = best[(name, False)], best[(name, True)]
        table.add_row(name, f"{hf:.3f}", f"{lean:.3f}", f"{hf / lean:.2f}x")
    table.add_row("drafter / target", f"{best[('drafter', False)] / best[('target', False)]:.3f}",
                  f"{best[('drafter', True)] / best[('target', True)]:.3f}", "")
    console.print(table)


def part2(prompts: int, target: str, repeats: int, console: Console) -> None:
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(repeats):
        for lean in (False, True):
            cfg = C.load_central_config("omnidraft", [f"params.prompts={prompts}", "params.dist_samples=0",
                                                      f"params.target={target}", f"params.lean_forward={lean}",
                                                      "tracking.enabled=false"], seed=0)
            runs[lean].append(run_central(cfg, show_progress=False))
    table = Table(title=f"OmniDraft stream of {prompts} prompts (greedy), best of {repeats} per path")
    for col in ("variant", "accepted/call", "speed-up, transformers", "speed-up, lean", "lean: drafter/target cost",
                "lean: share python"):
        table.add_column(col, justify="right")
    for v in "abcd":
        acc = {lean: runs[lean][0].metrics[f"accepted_per_call/{v}"] for lean in runs}
        assert acc[False] == acc[True], "the lean forward changed what was accepted"
        speed = {lean: max(r.metrics[f"speedup/{v}"] for r in runs[lean]) for lean in runs}
        lean_run = runs[True][0].metrics
        table.add_row(f"({v})", f"{acc[True]:.3f}", f"{speed[False]:.2f}x", f"{speed[True]:.2f}x",
                      f"{lean_run[f'timing/drafter_cost_ratio/{v}']:.3f}", f"{lean_run[f'timing/share_python/{v}']:.2f}")
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--target", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.repeats < 1:
        parser.error("--prompts and --repeats must be at least 1")
    torch.set_num_threads(1)
    console = Console()
    part1(OmniDraftParams(target=args.target), args.repeats, console)
    part2(args.prompts, args.target, args.repeats, console)


if __name__ == "__main__":
    main()
