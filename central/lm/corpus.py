"""The LM corpus: the Python standard library's own source, from the running interpreter.

The file list is the sorted non-test ``.py`` files of the stdlib (no ``test``/``tests``/``idle_test``
packages, no ``site-packages``), split into train and held-out *by file* with a seeded shuffle, so
held-out text never leaks into training.  The Python version is recorded: another interpreter
gives another corpus (about 730 files, 12 MB on Python 3.11).
"""

from __future__ import annotations

import random
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    train_files: tuple[Path, ...]
    heldout_files: tuple[Path, ...]
    python_version: str
    root: Path

    def text(self, files: tuple[Path, ...] | list[Path], max_chars: int | None = None) -> str:
        """The files' text joined by blank lines, cut at ``max_chars``."""
        out, total = [], 0
        for path in files:
            chunk = read_source(path)
            out.append(chunk)
            total += len(chunk) + 2
            if max_chars is not None and total >= max_chars:
                break
        joined = "\n\n".join(out)
        return joined[:max_chars] if max_chars is not None else joined

    def train_text(self, max_chars: int | None = None) -> str:
        return self.text(self.train_files, max_chars)

    def heldout_text(self, max_chars: int | None = None) -> str:
        return self.text(self.heldout_files, max_chars)

    def describe(self) -> dict[str, str | int]:
        return {"corpus.python": self.python_version, "corpus.train_files": len(self.train_files),
                "corpus.heldout_files": len(self.heldout_files)}


def read_source(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def stdlib_files() -> list[Path]:
    """The sorted, fixed list of non-test stdlib ``.py`` files of this interpreter."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not EXCLUDED_PARTS & set(p.relative_to(root).parts))


@lru_cache(maxsize=4)
def load_corpus(heldout_fraction: float = 0.1, seed: int = 0) -> Corpus:
    """Split the stdlib files into train / held-out by file (seeded, deterministic)."""
    files = stdlib_files()
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    n_held = max(1, int(round(heldout_fraction * len(files))))
    held = sorted(files[i] for i in order[:n_held])
    train = sorted(files[i] for i in order[n_held:])
    version = ".".join(map(str, sys.version_info[:3]))
    return Corpus(tuple(train), tuple(held), version, Path(sysconfig.get_paths()["stdlib"]))
