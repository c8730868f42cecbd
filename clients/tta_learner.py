"""Test-time adaptation as a fedsim learner: each node adapts a source model online on its own domain stream.

The regime (research notes ``continual.md`` §2, §7; the online TTA benchmark
``mariodoebler/test-time-adaptation``): a source model trained on clean images
(:mod:`clients.tta_source`) meets a stream of unlabeled test batches whose domain (a corruption of
:mod:`envs.corruptions`) changes without notice, cycle after cycle (:class:`envs.streams.DomainStream`).
A test-time method (:mod:`clients.tta`: source, BN-1, Tent, ETA/EATA, RDumb, LCoTTA) predicts each
batch, then adapts on it; accuracy is the online accuracy of those predictions.

**One round = one stream segment** (one (cycle, domain) block): in round r every node runs segment
r − 1 of its own stream through its method and replies with

* the method's *shared* state, the norm-layer affine parameters — the only parameters any of these
  methods changes — which the strategy averages (FedAvg weighted by examples);
* the block's counts (examples, correct predictions, predicted-class histogram) and the method's
  diagnostics as metrics; the server keeps every node's reply per round (``client_metrics``), and
  :meth:`TTALearner.final_report` merges them exactly into per-cycle / per-domain accuracy and
  collapse diagnostics (:class:`fedsim.metrics.stream.StreamRecorder`).

Everything else a method remembers between rounds (SGD momentum, the EMA of the mean prediction,
LCoTTA's gradient window and batch counter, RDumb's update counter) is *node-local*: it lives in the
node's ``context.state`` and never leaves the node, so engines that move nodes between workers
(ray) give the same result.  Centralised = one node (the server's average of one node is that
node's own parameters), so both run the same code.

Federated variant (what is shared and why): the norm affine parameters are averaged because they
are the whole adapted model; the gradient subspace stays local because each node's window tracks
its own stream (its own domain order when ``client_order`` is on, and its own noise).  A
server-tracked subspace is not implemented.  Each node holds an IID share of the clean test pool.

**Validation stream** (for tuning without the test stream): ``val_images`` > 0 splits the clean
held-out pool of ``test_images`` rows once (a fixed seeded permutation, the same for every run
seed) into a *validation pool* of ``val_images`` rows and the *test pool* of the other
``test_images − val_images`` rows; the source model never trains on either.  A run with
``split: val`` (or whose seed is in ``val_seeds``, which is how a claim spec's ``tune.seeds`` select
it) adapts on the **validation stream** instead of the test stream: images from the validation
pool only, its own corruption noise (stream seed ``derive_seed(seed, "tta-val-stream", node)``
instead of ``"tta-stream"``) and its own domain order (a seeded permutation of ``domains``, the same
in every cycle, instead of the benchmark order).  It logs its stream report under ``val/...``
(``val/acc_last_cycle``, ``val/acc_first_cycle``, ...) and no ``tta/...`` metric, and its clean
accuracy is measured on the validation pool, so a tuning run reads no test image.  With
``val_images`` = 0 (the default) the pool and every stream are exactly as before.

Claim diagnostics: with ``analysis_every`` > 0, the first batch of every that-many-th segment is
analysed before adapting (labels are known offline): per-sample gradient coherence of
entropy-truthful vs entropy-deceptive samples and the fraction of their gradients outside LCoTTA's
tracked subspace (:func:`clients.tta.analysis.group_report`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord

from fedsim.contracts.learner import EvalResult, Learner, NodeContext, StateDict, TrainResult
from clients.tta import TTAMethod, build_method, make_params, norm_state
from clients.tta.analysis import group_report
from clients.tta_source import SourceData, SourceRecipe, clean_accuracy, source_data, source_model
from envs.corruptions import BENCHMARK_ORDER
from envs.streams import DomainStream, DomainStreamConfig
from fedsim.config import ExperimentConfig
from fedsim.errors import ConfigError
from fedsim.metrics.stream import StreamRecorder, merge_recorders
from fedsim.registry import LEARNERS
from fedsim.seeding import derive_seed, numpy_rng

if TYPE_CHECKING:
    from fedsim.contracts.history import History

log = logging.getLogger("fedsim")

#: ``context.state`` record of the method's node-local state.
STATE_KEY = "tta-method"
#: The default domains: the TTA benchmark's corruption order (ImageNet-C's 15 without frost).
DEFAULT_DOMAINS = list(BENCHMARK_ORDER)


@dataclass
class TTAParams:
    """``client.params`` of the ``tta`` learner."""

    method: str = "lcotta"  # source | bn_adapt | tent | eata | rdumb | lcotta
    method_params: dict[str, Any] = field(default_factory=dict)  # the method's own params (clients.tta)
    # the stream (envs.streams.DomainStreamConfig)
    domains: list[str] = field(default_factory=lambda: list(DEFAULT_DOMAINS))
    cycles: int = 3
    severity: int = 5
    batch_size: int = 64
    setting: str = "continual"  # continual | reset_each_shift | gradual | mixed
    images_per_domain: int | None = None
    client_order: bool = True  # federated: each node sees the domains in its own order
    # the source model (trained once per seed and cached)
    source_epochs: int = 3
    source_lr: float = 1e-3
    test_images: int = 500  # clean pool held out for the streams (the rest trains the source)
    # the validation stream (module docstring): val_images of the held-out rows form its pool
    val_images: int = 0  # 0 = no validation pool (the test stream uses all test_images rows)
    split: str = "test"  # test | val: the stream this run adapts on
    val_seeds: list[int] = field(default_factory=list)  # runs with these seeds use split=val (tuning)
    # claim diagnostics
    analysis_every: int = 0  # analyse the first batch of every k-th segment (0 = off)


@LEARNERS.register("tta", params=TTAParams, summary="test-time adaptation on a corruption domain stream "
                                                    "(source, bn_adapt, tent, eata, rdumb, lcotta)")
class TTALearner(Learner):
    """Online test-time adaptation of a cached source model; one stream segment per round."""

    privacy_unit = ("test-time adaptation trains on the unlabeled test stream with batch statistics "
                    "(entropy/BN over a batch couples examples), so no per-example DP-SGD step applies")

    def __init__(self, cfg: ExperimentConfig, params: TTAParams) -> None:
        super().__init__(cfg, params)
        self._method: TTAMethod | None = None
        self._streams: dict[int, DomainStream] = {}

    # -- set-up -----------------------------------------------------------------------------------
    @property
    def recipe(self) -> SourceRecipe:
        p = self.params
        return SourceRecipe(self.cfg.data.name, self.cfg.model.name, dict(self.cfg.model.params), p.source_epochs,
                            p.source_lr, 64, p.test_images, 0, derive_seed(self.cfg.seed, "tta-source") % 2**31)

    @property
    def data(self) -> SourceData:
        return source_data(self.cfg.data.name, self.params.test_images, 0)

    @property
    def is_validation(self) -> bool:
        """Does this run adapt on the validation stream (``split: val`` or its seed in ``val_seeds``)?"""
        p = self.params
        return p.split == "val" or int(self.cfg.seed) in {int(s) for s in p.val_seeds}

    @property
    def prefix(self) -> str:
        """The run report's metric prefix: ``val`` on the validation stream, else ``tta``."""
        return "val" if self.is_validation else "tta"

    def pool_rows(self, split: str | None = None) -> np.ndarray:
        """The clean rows of the validation or test pool (sorted; disjoint, together the held-out rows)."""
        split = ("val" if self.is_validation else "test") if split is None else split
        rows, k = self.data.test_rows, self.params.val_images
        if k == 0:
            if split == "val":
                raise ConfigError("the validation stream needs client.params.val_images > 0")
            return rows
        perm = numpy_rng(0, "tta-val-split").permutation(len(rows))
        return np.sort(rows[perm[:k]] if split == "val" else rows[perm[k:]])

    def stream_config(self) -> DomainStreamConfig:
        p = self.params
        return DomainStreamConfig(list(p.domains), p.cycles, p.severity, p.batch_size, p.setting, p.images_per_domain)

    def client_rows(self, partition_id: int) -> np.ndarray:
        """The node's IID share of the clean pool of this run's split (seeded by the run seed)."""
        rows = self.pool_rows()
        perm = numpy_rng(self.cfg.seed, "tta-clients").permutation(len(rows))
        return np.sort(rows[np.array_split(perm, self.cfg.num_clients)[partition_id]])

    def stream(self, partition_id: int) -> DomainStream:
        if partition_id not in self._streams:
            data, federated = self.data, self.cfg.num_clients > 1
            order = derive_seed(self.cfg.seed, "tta-order", partition_id) if federated and self.params.client_order else None
            tag = "tta-stream"
            if self.is_validation:  # own noise and own domain order (module docstring)
                tag, order = "tta-val-stream", derive_seed(self.cfg.seed, "tta-val-order", partition_id)
            self._streams[partition_id] = DomainStream(
                data.images, data.labels, self.stream_config(), seed=derive_seed(self.cfg.seed, tag, partition_id),
                order_seed=order, indices=self.client_rows(partition_id), normalise=data.normalise)
        return self._streams[partition_id]

    @property
    def method(self) -> TTAMethod:
        if self._method is None:
            model, _ = source_model(self.recipe)
            self._method = build_method(self.params.method, model, self.data.num_classes, dict(self.params.method_params))
        return self._method

    def preflight(self) -> None:
        p = self.params
        make_params(p.method, dict(p.method_params))
        if p.analysis_every < 0:
            raise ConfigError(f"client.params.analysis_every must be >= 0, got {p.analysis_every}")
        if p.split not in ("test", "val"):
            raise ConfigError(f"client.params.split must be 'test' or 'val', got {p.split!r}")
        if not 0 <= p.val_images <= p.test_images - 2 * self.cfg.num_clients:
            raise ConfigError(f"client.params.val_images={p.val_images} must be in [0, test_images - 2 x clients] "
                              f"= [0, {p.test_images - 2 * self.cfg.num_clients}]")
        if self.is_validation and p.val_images == 0:
            raise ConfigError("this run adapts on the validation stream (split=val or its seed in val_seeds), "
                              "which needs client.params.val_images > 0")
        pool = len(self.pool_rows())
        if self.cfg.num_clients > pool // 2:
            raise ConfigError(f"{self.cfg.num_clients} clients cannot share {pool} stream images; "
                              f"lower num_clients or raise client.params.test_images")
        segments = self.stream(0).num_segments
        if self.cfg.rounds > segments:
            raise ConfigError(f"rounds={self.cfg.rounds} exceeds the stream's {segments} segments "
                              f"({p.cycles} cycles x {self.stream(0).segments_per_cycle}); set rounds={segments} "
                              f"or raise client.params.cycles")
        if self.cfg.strategy.fraction_train < 1.0:
            log.warning("tta: fraction_train=%s, so unsampled nodes skip their stream segment that round",
                        self.cfg.strategy.fraction_train)
        self.method  # builds (or loads) the source model now, before any run starts

    def local_work(self, partition_id: int) -> float:
        return float(self.stream(partition_id).batches_per_segment)

    # -- Learner API --------------------------------------------------------------------------------
    def init_arrays(self) -> StateDict:
        """The source model's norm affine parameters (from a fresh copy: the resident method may have adapted)."""
        return {k: v.detach().clone() for k, v in norm_state(source_model(self.recipe)[0]).items()}

    def _load(self, arrays: StateDict, ctx: NodeContext | None) -> TTAMethod:
        method = self.method
        method.load_shared_state(arrays)
        local = ctx.state[STATE_KEY].to_torch_state_dict() if ctx is not None and STATE_KEY in ctx.state else {}
        method.load_state_dict(local)
        return method

    def train(self, arrays: StateDict, ctx: NodeContext) -> TrainResult:
        method = self._load(arrays, ctx)
        stream = self.stream(ctx.partition_id)
        segment = ctx.server_round - 1
        batches = stream.segment(segment)
        recorder = StreamRecorder(self.data.num_classes)
        infos: list[dict[str, float]] = []
        analysis: dict[str, float] = {}
        every = self.params.analysis_every
        for i, batch in enumerate(batches):
            if batch.reset:
                method.reset()
            x, y = torch.from_numpy(batch.x), torch.from_numpy(batch.y)
            if i == 0 and every and segment % every == 0:
                analysis = self._analyse(method, x, y)
            logits = method.forward_and_adapt(x)
            recorder.record(batch.cycle, batch.domain, logits.detach().argmax(1), y)
            infos.append(dict(method.last_info))
        ctx.state[STATE_KEY] = ArrayRecord({k: v.detach().cpu() for k, v in method.state_dict().items()})
        block = recorder.total()
        metrics = {"acc": block.accuracy, "block/n": float(block.n), "block/correct": float(block.correct),
                   "distinct": float(block.distinct), "marginal_entropy": block.entropy(),
                   **{f"block/hist/{k}": float(c) for k, c in enumerate(block.hist)},
                   **_mean_info(infos), **analysis}
        shared = {k: v.detach().clone() for k, v in method.shared_state().items()}
        return TrainResult(shared, num_examples=block.n, metrics=metrics)

    def _analyse(self, method: TTAMethod, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """ET/ED gradient coherence (and out-of-subspace fractions, once LCoTTA tracks a subspace)."""
        if not method.param_list or len(y) < 2:
            return {f"analysis/{k}": math.nan for k in ANALYSIS_KEYS}
        e0 = getattr(method, "e_margin", 0.4 * math.log(self.data.num_classes))
        window = getattr(method, "window", None)
        rank = getattr(method.params, "rank", None)
        subspace = method.subspace()[0] if window is not None and rank and len(window) >= rank else None
        report = group_report(method.model, x, y, e0, subspace=subspace)
        return {f"analysis/{k}": float(report.get(k, math.nan)) for k in ANALYSIS_KEYS}

    def evaluate(self, arrays: StateDict, ctx: NodeContext) -> EvalResult:
        """The node's clean test share under the global norm parameters (no adaptation)."""
        method = self._load(arrays, None)
        rows = self.client_rows(ctx.partition_id)
        acc = clean_accuracy(method.model, self.data, len(rows), rows)
        return EvalResult(num_examples=len(rows), metrics={"clean_accuracy": acc})

    def evaluate_global(self, arrays: StateDict) -> dict[str, float]:
        """Accuracy of the global norm parameters on this run's clean pool (does adaptation forget the source?)."""
        method = self._load(arrays, None)
        return {"clean_accuracy": clean_accuracy(method.model, self.data, self.params.batch_size, self.pool_rows())}

    def setup_summary(self) -> dict[str, Any]:
        s = self.stream(0)
        return {"tta.pool_per_client": s.pool_size, "tta.segments": s.num_segments,
                "tta.batches_per_segment": s.batches_per_segment, "tta.norm_dim": sum(q.numel() for q in self.method.param_list)}

    # -- the run's report ---------------------------------------------------------------------------
    def recorder_from(self, history: "History") -> StreamRecorder:
        """Every node's block counts, placed at their (cycle, domain) and merged."""
        per_node: dict[int, StreamRecorder] = {}
        for record in history.records:
            for pid, m in record.client_metrics.items():
                if record.round < 1 or "block/n" not in m:
                    continue
                cycle, domain, _ = self.stream(pid).describe(record.round - 1)
                rec = per_node.setdefault(pid, StreamRecorder(self.data.num_classes, self.params.domains))
                hist = [m.get(f"block/hist/{k}", 0.0) for k in range(self.data.num_classes)]
                rec.add_counts(cycle, domain, int(m["block/n"]), int(m["block/correct"]), np.asarray(hist, dtype=np.int64))
        return merge_recorders(per_node.values()) if per_node else StreamRecorder(self.data.num_classes)

    def final_report(self, history: "History", out_dir: Path | None) -> tuple[dict[str, float], list[Path]]:
        rec = self.recorder_from(history)
        if not rec.blocks:
            return {}, []
        pre = self.prefix
        metrics = rec.summary_metrics(pre)
        cycles = rec.cycles
        last = rec.cycle_counts(cycles[-1])
        metrics.update({f"{pre}/acc_first_cycle": rec.cycle_counts(cycles[0]).accuracy, f"{pre}/acc_last_cycle": last.accuracy,
                        f"{pre}/distinct_last_cycle": float(last.distinct), f"{pre}/entropy_last_cycle": last.entropy(True),
                        f"{pre}/min_block_distinct_last_cycle": float(min(r["distinct"] for r in rec.rows()
                                                                           if r["cycle"] == cycles[-1]))})
        metrics.update(_analysis_means(history, pre))
        files: list[Path] = []
        if out_dir is not None:
            from fedsim.metrics.plots import plot_recorder_blocks, plot_recorders, save

            name = self.params.method
            title = f"{name}{' (validation stream)' if self.is_validation else ''}: {self.cfg.data.name}, {len(self.params.domains)} domains x {self.params.cycles} cycles, " \
                    f"{self.cfg.num_clients} node(s), seed {self.cfg.seed}"
            files.append(save(plot_recorders({name: rec}, title=title), out_dir / "tta_cycles.png"))
            files.append(save(plot_recorder_blocks({name: rec}, title=title), out_dir / "tta_blocks.png"))
            table = out_dir / "tta_blocks.csv"
            rows = rec.rows()
            table.write_text(",".join(rows[0]) + "\n" + "\n".join(",".join(str(v) for v in r.values()) for r in rows) + "\n")
            files.append(table)
        return {k: float(v) for k, v in metrics.items() if math.isfinite(v)}, files


#: Every diagnostic any method reports (``TTAMethod.last_info``) and every ET/ED analysis value: each
#: node replies with all of them (NaN where it has none), since Flower aggregates only replies whose
#: metrics share one key set.
INFO_KEYS = ("loss", "entropy", "kept_frac", "reliable_frac", "updated", "reset", "window", "projected",
             "explained_var", "kept_grad_frac")
ANALYSIS_KEYS = tuple(f"{stat}_{group}" for group in ("truthful", "deceptive")
                      for stat in ("n", "coherence", "grad_norm", "out_of_subspace"))


def _mean_info(infos: list[dict[str, float]]) -> dict[str, float]:
    """Batch-mean of each diagnostic the method reported (e.g. kept_frac, explained_var, projected)."""
    out = {}
    for k in INFO_KEYS:
        vals = [info[k] for info in infos if k in info and math.isfinite(info[k])]
        out[f"method/{k}"] = float(np.mean(vals)) if vals else math.nan
    return out


def _analysis_means(history: "History", prefix: str = "tta") -> dict[str, float]:
    """Run means of the ET/ED analysis and of the method's diagnostics over every (round, node) reporting them
    (``tta/analysis/*``, ``tta/method/*``: e.g. the gradient window's explained variance, the kept fraction;
    ``val/...`` on the validation stream)."""
    sums: dict[str, list[float]] = {}
    for record in history.records:
        for m in record.client_metrics.values():
            for k, v in m.items():
                if k.startswith(("analysis/", "method/")) and math.isfinite(v):
                    sums.setdefault(k, []).append(v)
    return {f"{prefix}/{k}": float(np.mean(v)) for k, v in sums.items()}
