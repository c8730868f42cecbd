"""A claim spec's shared checks for the centralised tests: valid children, none that no verdict reads."""

from __future__ import annotations

from typing import Any, Callable


def checked_claim_spec(name: str, check: Callable[[Any], None]) -> tuple[Any, list[dict[str, Any]]]:
    """``experiments/reproduce/NAME.yaml`` and its grid, after ``check`` passed on every child's method
    params and a claim, control or reference reads every child (an unread child only costs time)."""
    from fedsim import reproduce
    from fedsim.central_runner import method_params
    from fedsim.claim_protocol import read_configurations

    spec = reproduce.load_claim(name)
    grid = reproduce.settings(spec)
    for setting in grid:
        check(method_params(reproduce.build_config(spec, setting, 0)))
    assert read_configurations(spec, grid) == set(range(len(grid))), "a child that no verdict reads"
    return spec, grid


def read_metrics(spec: Any) -> set[str]:
    """Every metric a claim or positive control of ``spec`` reads."""
    comparisons = [*spec.claim, *(spec.controls.positive if spec.controls else [])]
    return {m for c in comparisons for m in c.metrics(spec.metric)}


def logged_metrics(summary: Any) -> set[str]:
    """Every metric name a central run returned or logged at any step."""
    return set(summary.metrics) | {k for record in summary.history.records for k in record.metrics}
