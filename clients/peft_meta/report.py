"""The ``lora_meta`` run's report: new-task accuracy over the rounds and its figure."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clients.peft_meta.params import LoraMetaParams
from fedsim.config import ExperimentConfig

if TYPE_CHECKING:
    from fedsim.contracts.history import History


def final_report(history: "History", out_dir: Path | None, params: LoraMetaParams,
                 cfg: ExperimentConfig) -> tuple[dict[str, float], list[Path]]:
    """Final, last-three, mean and best-round new-task accuracy (round 0 = the untrained base) and the plot."""
    rounds = [r for r in history.records if "eval/new_task_acc" in r.metrics]
    if not rounds:
        return {}, []
    accs = [r.metrics["eval/new_task_acc"] for r in rounds]
    last = rounds[-1].metrics
    metrics = {"new_task/acc_final": accs[-1], "new_task/acc_last3": float(np.mean(accs[-3:])),
               "new_task/acc_mean_rounds": float(np.mean(accs[1:] or accs)),
               "new_task/acc_round0": accs[0] if rounds[0].round == 0 else math.nan,  # the untrained base
               "new_task/acc_best_round": float(max(accs[1:] or accs)),
               "new_task/acc_before_final": last["eval/new_task_acc_before"],
               "new_task/gain_final": accs[-1] - last["eval/new_task_acc_before"]}
    files: list[Path] = []
    if out_dir is not None:
        from fedsim.metrics.plots import save

        files.append(save(figure(rounds, params, cfg), out_dir / "lora_meta_new_task.png"))
    return {k: float(v) for k, v in metrics.items() if math.isfinite(v)}, files


def figure(rounds: list[Any], params: LoraMetaParams, cfg: ExperimentConfig) -> Any:
    """New-task accuracy per round (after / before adaptation, retraining tasks) and adaptation curves."""
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    p = params
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r.round for r in rounds]
    ax1.plot(x, [r.metrics["eval/new_task_acc"] for r in rounds], marker="o", ms=3, label="after few-shot LoRA")
    ax1.plot(x, [r.metrics["eval/new_task_acc_before"] for r in rounds], ls="--", label="base alone (before)")
    ax1.plot(x, [r.metrics["eval/train_tasks_acc"] for r in rounds], ls=":", label="base alone, retraining tasks")
    ax1.set_xlabel("round")
    ax1.set_ylabel("test accuracy")
    task = "teacher task T" if p.tasks == "teacher" else f"{p.new_pair[0]}v{p.new_pair[1]}"
    ax1.set_title(f"{p.method}: new task {task}, {p.shots} shots, {p.ft_steps} steps")
    ax1.legend()
    ax1.grid(alpha=0.3)
    pts = sorted(p.curve_points)
    for r in [rounds[i] for i in sorted({0, len(rounds) // 2, len(rounds) - 1})]:
        ax2.plot(pts, [r.metrics[f"eval/new_task_acc_step{s}"] for s in pts], marker="o", label=f"round {r.round}")
    ax2.set_xlabel("fine-tuning step (fresh rank-k LoRA, base frozen)")
    ax2.set_ylabel("new-task test accuracy")
    ax2.set_title(f"adaptation curves ({cfg.num_clients} node(s), seed {cfg.seed})")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return fig
