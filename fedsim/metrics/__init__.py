"""The continual / test-time metric kernel.

* :mod:`fedsim.metrics.continual` -- accuracy-matrix metrics (average performance, forgetting,
  BWT, FWT) and normalised-AUC forward transfer from training curves, collected in
  :class:`ContinualReport`.
* :mod:`fedsim.metrics.stream` -- per-(cycle, domain) online accuracy and prediction-collapse
  diagnostics of a test-time domain stream, mergeable across federated clients.
* :mod:`fedsim.metrics.plots` -- figures for both (imported explicitly, so that clients needing
  only the counts do not import matplotlib).
"""

from fedsim.metrics.continual import (
    ContinualReport,
    average_own_performance,
    average_performance,
    backward_transfer,
    check_matrix,
    continual_report,
    curve_auc,
    forgetting,
    forgetting_per_task,
    forward_transfer,
    forward_transfer_per_task,
    normalized_forward_transfer,
    normalized_forward_transfer_per_task,
    running_average_performance,
)
from fedsim.metrics.stream import (
    BlockCounts,
    StreamRecorder,
    distinct_classes,
    least_squares_slope,
    marginal_entropy,
    merge_recorders,
)

__all__ = [
    "BlockCounts",
    "ContinualReport",
    "StreamRecorder",
    "average_own_performance",
    "average_performance",
    "backward_transfer",
    "check_matrix",
    "continual_report",
    "curve_auc",
    "distinct_classes",
    "forgetting",
    "forgetting_per_task",
    "forward_transfer",
    "forward_transfer_per_task",
    "least_squares_slope",
    "marginal_entropy",
    "merge_recorders",
    "normalized_forward_transfer",
    "normalized_forward_transfer_per_task",
    "running_average_performance",
]
