"""What a DP run releases that DP does not protect, said in one place and controllable.

The privacy ledger's ε covers the *model updates* a client sends: DP-SGD clips and noises every
gradient step on the client's private examples (``privacy.level=sample``), or the server clips
and noises each client's update (``privacy.level=client``).  Everything else a run records about
the clients is released without that protection.  With ``privacy.release=standard`` (the default)
a run releases :data:`UNPROTECTED`, and says so in its MLflow run (the ``privacy_release.md``
artifact and the ``privacy.release`` param).  ``privacy.release=strict`` withholds it:

* every train reply carries only the ledger's keys (``privacy/*``): no training loss, no other
  learner metric computed on private batches;
* every train reply weighs 1 (``num-examples = 1``), so FedAvg-family strategies average
  uniformly and no client's dataset size leaves the node;
* the learner's setup facts (dataset sizes) and setup plots (label histograms) are not logged;
* client-side evaluation (``strategy.fraction_evaluate > 0``, metrics on the clients' own test
  splits) is refused by the config check.

What strict still releases: the model (protected by the ledger's ε), the server-side evaluation
on the server's own test split (not client data), and round bookkeeping (how many clients
answered, timings).
"""

from __future__ import annotations

from typing import Any, Mapping

from fedsim.config import ExperimentConfig

#: What a ``privacy.release=standard`` DP run releases without DP protection: (what, where).
UNPROTECTED: tuple[tuple[str, str], ...] = (
    ("each round's training loss and the learner's other train metrics, computed on private batches",
     "train/* metrics (mean over the sampled clients) and each client's train metrics in the round records"),
    ("each client's exact training-set size", "num-examples of every train reply (the aggregation weights) "
                                               "and the learner's setup params (data.size.*)"),
    ("each client's label histogram", "the setup plot plots/label_histogram.png"),
    ("metrics of the global model on each client's own test split",
     "fed_eval/* metrics, when strategy.fraction_evaluate > 0"),
)
#: What every DP run releases and the ledger does not need to cover.
ALWAYS: tuple[tuple[str, str], ...] = (
    ("the global model after each round", "protected: the ledger's ε covers it"),
    ("the global model's metrics on the server's own test split", "eval/* (not client data)"),
    ("round bookkeeping", "round/* (clients that answered or failed, seconds)"),
    ("each client's DP sampling rate 1/⌈n/B⌉ and noise multiplier σ (sample-level DP)",
     "privacy_ledger.csv and the privacy/* reply metrics: NOT protected, they reveal each client's "
     "training-set size to within one batch (σ is calibrated per client); released in strict mode too"),
)
LEDGER_PREFIX = "privacy/"


def strict(cfg: ExperimentConfig) -> bool:
    return cfg.privacy.enabled and cfg.privacy.release == "strict"


def reply_metrics(cfg: ExperimentConfig, metrics: Mapping[str, Any], num_examples: int) -> tuple[dict[str, Any], int]:
    """The train metrics and weight a reply may carry under the run's release policy."""
    if not strict(cfg):
        return dict(metrics), num_examples
    return {k: v for k, v in metrics.items() if k.startswith(LEDGER_PREFIX)}, 1


def statement(cfg: ExperimentConfig) -> str:
    """The run's release statement (Markdown), logged as ``privacy_release.md``."""
    mode = cfg.privacy.release
    lines = [f"# What this run releases (privacy.release={mode}, privacy.level={cfg.privacy.level})", ""]
    lines += ["Released, and covered by DP or not about client data:", ""]
    lines += [f"- {what}: {where}" for what, where in ALWAYS]
    lines += ["", "Released WITHOUT DP protection:" if mode == "standard" else
              "Withheld (privacy.release=strict); a standard run would release without DP protection:", ""]
    lines += [f"- {what}: {where}" for what, where in UNPROTECTED]
    return "\n".join(lines) + "\n"
