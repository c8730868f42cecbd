"""CKA-RL and its baselines on a continual CartPole task stream, as a fedsim learner (``ckarl``).

Paper: "Continual Knowledge Adaptation for Reinforcement Learning" (Hu et al., NeurIPS 2025,
OpenReview ``QRlVickNdN``); the method is in :mod:`algorithms.ckarl.ckarl`, the baselines (from scratch,
FT-1, FT-N) in :mod:`algorithms.ckarl.baselines`, PPO in :mod:`algorithms.ckarl.ppo`, the stream in
:mod:`envs.rl_tasks`.  The learner owns its environment and model: ``cfg.data`` and ``cfg.model``
are ignored (every setting is in ``client.params``, :class:`algorithms.ckarl.config.RLParams`).

**Rounds.** A task lasts ``rounds_per_task`` rounds; in each round every node runs
``steps_per_task / rounds_per_task`` environment steps of PPO (CleanRL iterations of 4 envs x 128
steps) on its own instance of the current task, continuing its episodes and Adam moments from its
previous round (node-local ``ctx.state``).  ``rounds`` must be tasks x rounds_per_task.

**What travels.** The method's arrays (:mod:`algorithms.ckarl.agent`): the keys trained in the current
task (CKA-RL: v_k, beta_k and the critic; the baselines: the actor and the critic) are averaged by
the ``ckarl`` strategy (FedAvg weighted by steps, i.e. uniformly); theta_base, the pool and the
stored copies are global and only the server changes them: after a task's last round it pushes v_k
into the pool and runs Adaptive Knowledge Merging (:func:`algorithms.ckarl.node.server_update`).  The
critic is shared and averaged too (it is re-initialised at every task, and PPO needs one).
Centralised = one node (nominal physics); federated = several nodes, each with its own physics
noise on every task (``client_physics_std``), the same task order.

**Evaluation.** After every task's last round (and at round 0) the server evaluates, on every task's
nominal physics, the task-aware policy and the latest policy (``eval/ret_t{j}``,
``eval/succ_t{j}``, ``eval/latest_ret_t{j}``, ``eval/latest_succ_t{j}``, ``eval/memory``,
``eval/pool_size``); these rows form the return matrices.  After the last task the task-aware
policies are also evaluated greedily (``eval/greedy_ret_t{j}``, argmax actions): the learnt
controller without exploration noise, whose worst task is the stream's validity bar for ``scratch``.  :meth:`RLLearner.final_report` adds the
paper's metrics (:mod:`algorithms.ckarl.report`) and plots.

**Reference.** Success thresholds (0.8 x a from-scratch agent's final return per task, as CompoNet's
``process_results.py`` defines success) and FWT's baseline curves come from the from-scratch
reference :func:`algorithms.ckarl.node.reference`: method ``scratch`` run once, centralised, on the same
stream, PPO settings, schedule and seed, and cached on disk (``$FEDSIM_CACHE/rl-reference``).  It
costs one scratch run the first time per seed.  Federated runs are compared with the same
centralised reference.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedsim.contracts.learner import EvalResult, Learner, NodeContext, StateDict, TrainResult
from algorithms.ckarl.agent import Method
from algorithms.ckarl.ckarl import CKARL
from algorithms.ckarl.config import RLParams, build_method
from algorithms.ckarl.evaluation import EvalCache, evaluate_returns
from algorithms.ckarl.node import NodeState, Reference, eval_seed, node_task, reference, train_round
from algorithms.ckarl.report import RunCurves, curve_metrics, matrix_metrics, plot_curves, plot_memory, similar_tasks
from fedsim.config import ExperimentConfig
from fedsim.errors import ConfigError
from fedsim.registry import LEARNERS

if TYPE_CHECKING:
    from fedsim.contracts.history import History

log = logging.getLogger("fedsim")

STATE_ARRAYS = "rl-node"
STATE_META = "rl-node-meta"
ENV_ARRAYS = ("state", "elapsed", "beyond")


@LEARNERS.register("ckarl", params=RLParams, summary="continual RL on a CartPole task stream: CKA-RL "
                                                    "(knowledge-vector pool + merging), scratch, FT-1, FT-N (PPO)")
class RLLearner(Learner):
    """Continual PPO over a gymnasium task stream (see the module docstring)."""

    privacy_unit = ("RL trains on environment trajectories, not a fixed set of private examples: "
                    "the unit would be an episode, and episode-level DP is not implemented")

    owns_environment = True  # the task stream and the actor-critic come from client.params

    def __init__(self, cfg: ExperimentConfig, params: RLParams) -> None:
        super().__init__(cfg, params)
        self._method: Method | None = None
        self._reference: Reference | None = None
        self._reference_cached = False
        self._eval = EvalCache()

    # -- set-up -------------------------------------------------------------------------------------
    @property
    def p(self) -> RLParams:
        return self.params

    @property
    def method(self) -> Method:
        if self._method is None:
            self.p.validate()
            self._method = build_method(self.p, self.cfg.seed)
        return self._method

    @property
    def reference(self) -> Reference | None:
        if self.p.reference and self._reference is None:
            self._reference, self._reference_cached = reference(self.p, self.cfg.seed)
        return self._reference

    def thresholds(self) -> np.ndarray | None:
        ref = self.reference
        return None if ref is None else ref.thresholds(self.p.success_frac)

    def preflight(self) -> None:
        p, cfg = self.p, self.cfg
        p.validate()
        if cfg.rounds != p.rounds:
            raise ConfigError(f"rounds={cfg.rounds} but the stream needs {p.num_tasks} tasks x "
                              f"{p.rounds_per_task} rounds_per_task; set rounds={p.rounds}")
        if cfg.strategy.name != "ckarl":
            raise ConfigError(f"the ckarl learner needs strategy.name=ckarl (it keeps theta_base, the pool and the "
                              f"stored copies global and merges on the server), got {cfg.strategy.name!r}")
        if cfg.privacy.enabled:
            raise ConfigError("the ckarl learner has no differential privacy; drop privacy.enabled / --eps")
        if cfg.strategy.fraction_train < 1.0:
            log.warning("ckarl: fraction_train=%s, so unsampled nodes skip rounds; a node rejoining mid-task "
                        "restarts its environment and optimiser", cfg.strategy.fraction_train)
        self.method
        if p.reference and self._reference is None:
            log.info("ckarl: loading or training the from-scratch reference (one scratch run per seed, cached)")
        self.reference

    def local_work(self, partition_id: int) -> float:
        return float(self.p.iterations_per_round * self.p.ppo.update_epochs * self.p.ppo.num_minibatches)

    def setup_summary(self) -> dict[str, Any]:
        m = self.method
        out: dict[str, Any] = {"rl.tasks": self.p.num_tasks, "rl.iterations_per_round": self.p.iterations_per_round,
                               "rl.actor_params": m.actor_mlp.numel, "rl.critic_params": m.critic_mlp.numel,
                               "rl.task_names": ",".join(self.p.stream(self.cfg.seed).names)}
        if self.p.reference:
            out["rl.reference_cached"] = int(self._reference_cached)
            out.update({f"rl.threshold_t{j}": float(t) for j, t in enumerate(self.thresholds())})
        return out

    # -- Learner API ----------------------------------------------------------------------------------
    def init_arrays(self) -> StateDict:
        return self.method.init_arrays()

    def train(self, arrays: StateDict, ctx: NodeContext) -> TrainResult:
        out, state, metrics = train_round(self.p, self.method, arrays, _load_state(ctx), ctx.server_round,
                                          ctx.partition_id, self.cfg.num_clients, self.cfg.seed)
        _save_state(ctx, state)
        steps = self.p.iterations_per_round * self.p.ppo.batch_size
        return TrainResult({k: v.detach().clone() for k, v in out.items()}, num_examples=steps, metrics=metrics,
                           owned=True)

    def evaluate(self, arrays: StateDict, ctx: NodeContext) -> EvalResult:
        """The latest policy on this node's instance of the current task."""
        m, p = self.method, self.p
        done = int(arrays["round"].item()) // p.rounds_per_task
        k = min(done, p.num_tasks - 1)
        task = node_task(p, self.cfg.seed, k, ctx.partition_id, self.cfg.num_clients)
        rets = evaluate_returns(m.actor_mlp, m.latest_actor(arrays, done), task, p.eval_episodes,
                                eval_seed(self.cfg.seed, k), p.eval_greedy)
        return EvalResult(num_examples=len(rets), metrics={"ret": float(rets.mean())})

    def evaluate_global(self, arrays: StateDict) -> dict[str, float]:
        """At round 0 and after every task: every task under the task-aware and the latest policy."""
        p, m = self.p, self.method
        rnd = int(arrays["round"].item())
        if rnd % p.rounds_per_task:
            return {}
        done = rnd // p.rounds_per_task
        stream, thr = p.stream(self.cfg.seed), self.thresholds()
        out: dict[str, float] = {"memory": float(m.memory(arrays, done)), "tasks_done": float(done)}
        if isinstance(m, CKARL):
            out["pool_size"] = float(m.pool_size(arrays))
        latest = m.latest_actor(arrays, done)
        for j in range(p.num_tasks):
            for name, actor in (("", m.task_actor(arrays, j, done)), ("latest_", latest)):
                rets = self._eval.returns(m.actor_mlp, actor, j, stream[j].train, p.eval_episodes,
                                          eval_seed(self.cfg.seed, j), p.eval_greedy)
                out[f"{name}ret_t{j}"] = float(rets.mean())
                if thr is not None:
                    out[f"{name}succ_t{j}"] = float((rets >= thr[j]).mean())
        if done == p.num_tasks:  # the learnt controllers, deterministic: argmax actions (the validity bar)
            for j in range(p.num_tasks):
                rets = evaluate_returns(m.actor_mlp, m.task_actor(arrays, j, done), stream[j].train, p.eval_episodes,
                                        eval_seed(self.cfg.seed, j), greedy=True)
                out[f"greedy_ret_t{j}"] = float(rets.mean())
        return out

    # -- the run's report -------------------------------------------------------------------------------
    def curves(self, history: "History") -> np.ndarray:
        """(tasks, iterations) training returns: per iteration, the episode-weighted mean over nodes."""
        p = self.p
        ipr = p.iterations_per_round
        total = np.zeros((p.rounds, ipr))
        count = np.zeros((p.rounds, ipr))
        for record in history.records:
            if not 1 <= record.round <= p.rounds:
                continue
            for m in record.client_metrics.values():
                if "curve/0" not in m:
                    continue
                for i in range(ipr):
                    ret, n = m[f"curve/{i}"], m[f"curve_n/{i}"]
                    if n > 0 and math.isfinite(ret):
                        total[record.round - 1, i] += ret * n
                        count[record.round - 1, i] += n
        with np.errstate(invalid="ignore", divide="ignore"):
            per = np.where(count > 0, total / np.maximum(count, 1), np.nan)
        return per.reshape(p.num_tasks, p.iterations_per_task)

    def matrices(self, history: "History") -> dict[str, np.ndarray] | None:
        """Rows of the end-of-task evaluations: R/L returns and successes (T x T), the initial row."""
        p, T = self.p, self.p.num_tasks
        by_round = {r.round: r.metrics for r in history.records}
        rows = [by_round.get(done * p.rounds_per_task, {}) for done in range(T + 1)]
        if any("eval/ret_t0" not in r for r in rows):
            return None
        get = lambda prefix, r: np.array([r.get(f"eval/{prefix}_t{j}", math.nan) for j in range(T)])  # noqa: E731
        out = {name: np.stack([get(prefix, r) for r in rows[1:]]) for name, prefix in
               (("R_ret", "ret"), ("L_ret", "latest_ret"), ("R_succ", "succ"), ("L_succ", "latest_succ"))}
        out["initial_succ"] = get("succ", rows[0])
        out["memory"] = np.array([r.get("eval/memory", math.nan) for r in rows[1:]])
        out["pool"] = np.array([r.get("eval/pool_size", math.nan) for r in rows[1:]])
        out["greedy"] = get("greedy_ret", rows[-1])
        return out

    def final_report(self, history: "History", out_dir: Path | None) -> tuple[dict[str, float], list[Path]]:
        p = self.p
        if not any(r.round == p.rounds for r in history.records):
            return {}, []
        curves = self.curves(history)
        ref, thr = self.reference, self.thresholds()
        metrics = curve_metrics(RunCurves(curves, None if ref is None else ref.curves, thr, similar_tasks(p.tasks)),
                                p.smooth)
        mats = self.matrices(history)
        if mats is not None:
            base = mats["initial_succ"] if np.isfinite(mats["initial_succ"]).all() else None
            metrics.update(matrix_metrics(mats["R_succ"], mats["L_succ"], mats["R_ret"], mats["L_ret"], base,
                                          mats["greedy"]))
            metrics["memory_params"] = float(mats["memory"][-1])
            metrics["memory_max"] = float(np.nanmax(mats["memory"]))
            if np.isfinite(mats["pool"]).any():
                metrics["pool_size"] = float(mats["pool"][-1])
                metrics["pool_max"] = float(np.nanmax(mats["pool"]))
        out = {f"rl/{k}": float(v) for k, v in metrics.items() if math.isfinite(v)}
        files = self._plots(curves, mats, out_dir) if out_dir is not None else []
        return out, files

    def _plots(self, curves: np.ndarray, mats: dict[str, np.ndarray] | None, out_dir: Path) -> list[Path]:
        from fedsim.metrics.plots import plot_accuracy_matrix, save

        p, cfg = self.p, self.cfg
        names = p.stream(cfg.seed).names
        title = f"{p.method}: {p.num_tasks} CartPole tasks x {p.steps_per_task} steps, {cfg.num_clients} node(s), " \
                f"seed {cfg.seed}"
        ref = self.reference
        files = [save(plot_curves(curves, None if ref is None else ref.curves, self.thresholds(), names,
                                  p.steps_per_task, p.smooth, title), out_dir / "rl_curves.png")]
        table = ["kind,row," + ",".join(names)]
        table += [",".join([f"curve,{names[j]}", *(f"{v:.3f}" for v in curves[j])]) for j in range(p.num_tasks)]
        if mats is not None:
            for key, label in (("R_ret", "task-aware policy"), ("L_ret", "latest policy")):
                fig = plot_accuracy_matrix(mats[key], names, fmt=".0f", vmin=0, vmax=500,
                                           title=f"{p.method}: mean return, {label}")
                files.append(save(fig, out_dir / f"rl_matrix_{key[0].lower()}.png"))
                table += [",".join([key, str(i), *(f"{v:.2f}" for v in mats[key][i])]) for i in range(p.num_tasks)]
            pool = mats["pool"] if np.isfinite(mats["pool"]).any() else None
            files.append(save(plot_memory(mats["memory"], pool, self.method.actor_mlp.numel, title),
                              out_dir / "rl_memory.png"))
        csv = out_dir / "rl_report.csv"
        csv.write_text("\n".join(table) + "\n")
        files.append(csv)
        return files


def _load_state(ctx: NodeContext) -> NodeState | None:
    if STATE_ARRAYS not in ctx.state or STATE_META not in ctx.state:
        return None
    arrays = {k: v.numpy() for k, v in ctx.state[STATE_ARRAYS].to_torch_state_dict().items()}
    meta = ctx.state[STATE_META]
    env = {k: arrays[f"env/{k}"] for k in ENV_ARRAYS}
    env["rng"] = str(meta["rng"])
    rollout = {k[len("rollout/"):]: v for k, v in arrays.items() if k.startswith("rollout/")}
    optim = {k[len("optim/"):]: torch.from_numpy(v) for k, v in arrays.items() if k.startswith("optim/")}
    return NodeState(int(meta["task"]), env, rollout, optim)


def _save_state(ctx: NodeContext, state: NodeState) -> None:
    tensors = {f"env/{k}": torch.from_numpy(np.ascontiguousarray(state.env[k])) for k in ENV_ARRAYS}
    tensors.update({f"rollout/{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.rollout.items()})
    tensors.update({f"optim/{k}": v for k, v in state.optim.items()})
    ctx.state[STATE_ARRAYS] = ArrayRecord(tensors)
    ctx.state[STATE_META] = ConfigRecord({"task": state.task, "rng": state.env["rng"]})
