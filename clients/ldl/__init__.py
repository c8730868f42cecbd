"""Semi-supervised label distribution learning (RankMatch and baselines): measures, losses, augmentations, recipes.

* :mod:`clients.ldl.measures` — the six LDL measures (Geng's survey) and per-instance Spearman / Kendall.
* :mod:`clients.ldl.losses` — KL and the pairwise relevance-ranking loss (margin / order only).
* :mod:`clients.ldl.augment` — weak and strong augmentations of images and tabular features.
* :mod:`clients.ldl.methods` — the six methods as recipes over one loss; pseudo-distributions.
* :mod:`clients.ldl.environment`, :mod:`clients.ldl.training`, :mod:`clients.ldl.report` — the
  learner's parts: data, rows and network per node; one node's round (plain or DP-SGD) and the
  evaluations; the run's summary, plots and table.

The learner that runs them is :mod:`clients.ldl_learner` (``client.learner: ldl``).
"""

from clients.ldl.losses import kl_loss, prr_loss
from clients.ldl.measures import (HIGHER_IS_BETTER, MEASURES, RANKS, kendall_rows, ldl_measures, per_instance,
                                  spearman_rows)
from clients.ldl.methods import RECIPES, Recipe, Weights, pseudo_distributions, recipe_of, step_loss

__all__ = ["HIGHER_IS_BETTER", "MEASURES", "RANKS", "RECIPES", "Recipe", "Weights", "kendall_rows", "kl_loss",
           "ldl_measures", "per_instance", "prr_loss", "pseudo_distributions", "recipe_of", "spearman_rows",
           "step_loss"]
