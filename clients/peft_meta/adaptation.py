"""Server-side evaluation of a retrained base: a fresh rank-k LoRA fitted on a few shots of the new
task (base frozen), and the base alone on the retraining tasks' test images."""

from __future__ import annotations

import numpy as np
import torch

from clients.lora_meta_model import LoraNet
from clients.peft_meta.environment import TaskEnvironment, balanced_shots, scores
from clients.peft_meta.methods import train_step
from fedsim.contracts.learner import StateDict
from fedsim.seeding import derive_seed, numpy_rng


def shot_indices(env: TaskEnvironment, repeat: int) -> np.ndarray:
    """The ``repeat``-th seeded draw of balanced shots from the new pair's pool (same for every method)."""
    rng = numpy_rng(env.cfg.seed, "lora-meta-shots", repeat)
    return balanced_shots(env.new_task.y_train, env.params.shots, rng)


def fit_new_lora(env: TaskEnvironment, arrays: StateDict, repeat: int) -> tuple[LoraNet, dict[str, float]]:
    """Fit a fresh rank-k LoRA (one slot, B = 0: starts as the base) on one draw of shots, base frozen
    (full-batch Adam, ``ft_steps`` steps); returns the model and its new-task test scores."""
    p, new = env.params, env.new_task
    idx = torch.from_numpy(shot_indices(env, repeat))
    xs, ys = new.x_train[idx], new.y_train[idx]
    model = env.model(1)
    model.load_part(arrays)
    model.reset_adapters([derive_seed(env.cfg.seed, "lora-meta-ft", repeat)])
    for q in model.base_parameters():
        q.requires_grad_(False)
    opt = torch.optim.Adam(model.adapter_parameters(), lr=p.ft_lr)
    slot_s = torch.zeros(len(ys), dtype=torch.long)
    slot_t = torch.zeros(len(new.y_test), dtype=torch.long)
    out: dict[str, float] = {}
    checkpoints = set(p.curve_points) | {0}
    for step in range(p.ft_steps):
        if step in checkpoints:
            out[f"acc_step{step}"] = scores(model, new.x_test, new.y_test, slot_t)[1]
        model.train()
        train_step(opt, model(xs, slot_s), ys)
    out["loss"], out["acc"] = scores(model, new.x_test, new.y_test, slot_t)  # scored once at the end
    if new.x_val is not None and new.y_val is not None:  # the teacher family: selection on validation only
        out["val_acc"] = scores(model, new.x_val, new.y_val, torch.zeros(len(new.y_val), dtype=torch.long))[1]
    if p.ft_steps in checkpoints:
        out[f"acc_step{p.ft_steps}"] = out["acc"]
    return model, out


def evaluate_new_task(env: TaskEnvironment, arrays: StateDict) -> dict[str, float]:
    """Few-shot adaptation of a fresh rank-k LoRA on the new task (base frozen), averaged over draws;
    plus the base alone on the retraining tasks' test images."""
    p = env.params
    runs = [fit_new_lora(env, arrays, r)[1] for r in range(p.ft_repeats)]
    out = {"new_task_acc": float(np.mean([r["acc"] for r in runs])),
           "new_task_loss": float(np.mean([r["loss"] for r in runs])),
           "new_task_acc_before": float(np.mean([r[f"acc_step{0}"] for r in runs]))}
    if "val_acc" in runs[0]:
        out["val/new_task_acc"] = float(np.mean([r["val_acc"] for r in runs]))  # logged unprefixed (tuning)
    for s in p.curve_points:
        out[f"new_task_acc_step{s}"] = float(np.mean([r[f"acc_step{s}"] for r in runs]))
    x = torch.cat([t.x_test for t in env.tasks])
    y = torch.cat([t.y_test for t in env.tasks])
    out["train_tasks_acc"] = scores(env.plain(arrays), x, y, None)[1]
    return out
