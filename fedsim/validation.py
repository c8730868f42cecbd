"""One generic validation pass over the typed config: ranges declared once, next to each field.

A numeric field declares its range with :func:`rng` (``lr: float = rng("(0, inf)", 0.05)``), a text
field its length with :func:`text`; :func:`check_fields` walks the dataclasses (nested ones and
mappings of them included) and reports the first violation on one line, e.g.
``engine.round_timeout_s must be in (0, 1e6] (a finite number), got inf``.  A new field gets
validation by declaring its range.  Values must be finite unless the range says otherwise.

Also here: the interpolation guard (only plain ``${a.b}`` references, no resolvers such as
``oc.env``), MLflow run-id and writable-directory checks, all run before anything starts.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from fedsim.errors import ConfigError

_INTERVAL = re.compile(r"^\s*([\[(])\s*([^,\s]+)\s*,\s*([^\]\s)]+)\s*([\])])\s*$")


@dataclass(frozen=True)
class Range:
    """A closed/open interval; ``finite`` rejects NaN and ±inf whatever the bounds."""

    low: float
    high: float
    low_open: bool
    high_open: bool
    finite: bool = True

    @classmethod
    def parse(cls, interval: str, finite: bool = True) -> "Range":
        """``"(0, 1e6]"`` → Range(0, 1e6, low_open=True, high_open=False)."""
        m = _INTERVAL.match(interval)
        if not m:
            raise ValueError(f"bad interval {interval!r}: write e.g. '(0, 1e6]' or '[0, inf)'")
        return cls(float(m.group(2)), float(m.group(3)), m.group(1) == "(", m.group(4) == ")", finite)

    def contains(self, value: float) -> bool:
        if math.isnan(value) or (self.finite and math.isinf(value)):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self, integer: bool) -> str:
        """``in (0, 1e6] (a finite number)`` / ``in [1, 100000] (an integer)``."""
        kind = "an integer" if integer else ("a finite number" if self.finite else "a number")
        lo, hi = _fmt(self.low, integer), _fmt(self.high, integer)
        return f"in {'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open else ']'} ({kind})"


def _fmt(x: float, integer: bool) -> str:
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if integer or (x.is_integer() and abs(x) < 1e5):
        return str(int(x))
    return f"{x:g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


def rng(interval: str, default: Any, *, finite: bool = True) -> Any:
    """A dataclass field whose value (when not None) must lie in ``interval``."""
    return field(default=default, metadata={"range": Range.parse(interval, finite)})


def text(default: str, *, max_len: int, nonempty: bool = False) -> Any:
    """A dataclass string field of at most ``max_len`` characters (and not empty, if asked)."""
    return field(default=default, metadata={"max_len": max_len, "nonempty": nonempty})


def check_fields(obj: Any, prefix: str = "") -> None:
    """Check every declared range and length in the dataclass ``obj`` and the ones nested in it."""
    for f in fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if "range" in f.metadata and value is not None:
            _check_number(key, value, f.metadata["range"])
        if "max_len" in f.metadata and value is not None:
            _check_text(key, value, f.metadata["max_len"], f.metadata.get("nonempty", False))
        if is_dataclass(value):
            check_fields(value, f"{key}.")
        elif isinstance(value, dict):
            for k, item in value.items():
                if is_dataclass(item):
                    check_fields(item, f"{key}.{k}.")


def _check_number(key: str, value: Any, spec: Range) -> None:
    integer = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not spec.contains(float(value)):
        raise ConfigError(f"{key} must be {spec.describe(integer)}, got {value!r}"[:300])


def _check_text(key: str, value: str, max_len: int, nonempty: bool) -> None:
    if nonempty and not value.strip():
        raise ConfigError(f"{key} must not be empty")
    if len(value) > max_len:
        raise ConfigError(f"{key} is {len(value)} characters long; shorten it to at most {max_len}")


# --- interpolations --------------------------------------------------------------------------

#: ``${a.b}``, ``${.sibling}``, ``${a.list[0]}``: references to other config keys, nothing else.
_PLAIN_REF = re.compile(r"\$\{\.*[A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*|\[\d+\])*\}")


def check_interpolations(value: Any, where: str) -> None:
    """Reject resolvers (``${oc.env:VAR}``, ``${any:...}``) in ``value`` (nested lists/dicts walked).

    A resolver can pull environment variables (tokens) into the config, which is logged to MLflow.
    """
    if isinstance(value, dict):
        for k, v in value.items():
            check_interpolations(v, f"{where}{k}" if not where or where.endswith(" ") else f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_interpolations(v, f"{where}[{i}]")
    elif isinstance(value, str) and "${" in value and "${" in _PLAIN_REF.sub("", value.replace("\\${", "")):
        raise ConfigError(f"{where}: {_short(value)} uses a resolver; only references to other keys (${{a.b}}) "
                          f"are allowed, since a resolver such as oc.env could copy secrets into the logged "
                          f"params; pass the value itself as an override or flag instead")


def _short(value: str, limit: int = 80) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "...")


# --- run ids and paths -----------------------------------------------------------------------

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def check_run_id(run_id: str, what: str = "run id") -> str:
    """An MLflow run id is 32 lowercase hex characters."""
    if not _RUN_ID.match(run_id):
        raise ConfigError(f"{what} {_short(run_id, 40)} is not an MLflow run id (32 hex characters, as shown "
                          f"by `fedsim ui` or printed at the end of a run)")
    return run_id


def check_writable_dir(path: str | Path, what: str) -> None:
    """``path`` is, or can be created as, a directory we can write to (nothing is left behind)."""
    p = Path(path).expanduser()
    try:
        p = p.resolve()
    except (OSError, RuntimeError) as exc:
        raise ConfigError(f"{what} {str(path)!r} is not a usable path ({exc}); choose another") from None
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{what} {str(path)!r}: {existing} is not a directory; choose a directory path")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not writable ({exc.strerror or exc} in {existing}); "
                          f"choose a writable directory") from None
    if existing != p and not os.access(existing, os.W_OK | os.X_OK):  # pragma: no cover - root ignores modes
        raise ConfigError(f"{what} {str(path)!r} cannot be created in {existing}; choose a writable directory")
