"""The matplotlib backend for plots fedsim writes to files."""

from __future__ import annotations

import sys


def use_agg() -> None:
    """Select the file-only Agg backend, unless the caller already chose one by importing pyplot.

    A notebook (``%matplotlib inline``) or a GUI session keeps its backend, so fedsim's plots
    show there too; a headless run (CLI, tests, Ray workers) gets Agg and never needs a display.
    """
    if "matplotlib.pyplot" not in sys.modules:
        import matplotlib

        matplotlib.use("Agg")
