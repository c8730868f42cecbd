"""The adapt/retain trade-off of a set of (retention, new-task accuracy) points: Pareto front and hypervolume."""

from __future__ import annotations

from typing import Sequence

Point = tuple[float, float]


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The non-dominated points (both coordinates maximised), sorted by retention, descending."""
    front: list[Point] = []
    for x, y in sorted(set(points), key=lambda p: (-p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


def hypervolume(points: Sequence[Point], ref: Point) -> float:
    """Area dominated by ``points`` and dominating ``ref`` (2-D, both coordinates maximised)."""
    area, y_prev = 0.0, ref[1]
    for x, y in pareto_front(points):
        if x > ref[0] and y > y_prev:
            area += (x - ref[0]) * (y - y_prev)
            y_prev = y
    return area


def normalised_hypervolume(points: Sequence[Point], ref: Point) -> float:
    """:func:`hypervolume` divided by that of the ideal point (1, 1): 1 = perfect on both tasks."""
    return hypervolume(points, ref) / ((1.0 - ref[0]) * (1.0 - ref[1]))


def best_new_at_retention(points: Sequence[Point], floor: float, fallback: float) -> float:
    """The best new-task accuracy among points keeping retention ≥ ``floor`` (``fallback`` if none)."""
    kept = [y for x, y in points if x >= floor]
    return max(kept) if kept else fallback
