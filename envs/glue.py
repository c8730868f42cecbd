"""``glue``: a GLUE task read from local TSV files, tokenised with a local Hugging Face tokenizer.

What: the ``train.tsv`` and dev file (``dev.tsv``; MNLI: ``dev_matched.tsv``) of one GLUE task in
the layout of the official GLUE download (tab-separated, no quoting, a header row except CoLA),
tokenised with the tokenizer stored in ``data.params.tokenizer`` (the model directory: FedSVD's
``roberta-large``) to ``max_len`` ids, right-padded with the tokenizer's pad id.  Sentence pairs are
encoded as the tokenizer's pair input (RoBERTa: ``<s> a </s></s> b </s>``); token-type ids are not
kept (RoBERTa does not use them).

Why: FedSVD (Lee et al., arXiv 2505.12805) reports GLUE dev accuracy of RoBERTa-large + LoRA; this
is its paper-scale data source.  Nothing is downloaded: the user gives both paths.

Split: the rows are train rows then dev rows, and :attr:`GlueDataset.test_index` marks the dev rows
as the **server test split** (``data.test_fraction`` is then ignored); clients partition the train
rows only.  Labels follow Hugging Face ``datasets``' GLUE order (e.g. MNLI entailment/neutral/
contradiction = 0/1/2).  A row whose label is not one of the task's labels (or has too few fields)
is a one-line error naming the file and line.  SNLI (in the authors' code) is not in GLUE format and
is not read here.
"""

from __future__ import annotations

import csv
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from envs.datasets import ArrayDataset
from fedsim.errors import ConfigError
from fedsim.registry import DATASETS


@dataclass(frozen=True)
class GlueTask:
    """Column layout of one GLUE task: text column(s), label column, label values, dev file name.

    Columns are header names, or 0-based indices for a headerless file (``header=False``).
    """

    text: tuple[str | int, ...]
    label: str | int
    labels: tuple[str, ...]
    dev_file: str = "dev.tsv"
    header: bool = True


#: The GLUE classification tasks (STS-B, a regression task, and WNLI are not included).
GLUE_TASKS: dict[str, GlueTask] = {
    "sst2": GlueTask(("sentence",), "label", ("0", "1")),
    "cola": GlueTask((3,), 1, ("0", "1"), header=False),
    "mrpc": GlueTask(("#1 String", "#2 String"), "Quality", ("0", "1")),
    "qqp": GlueTask(("question1", "question2"), "is_duplicate", ("0", "1")),
    "qnli": GlueTask(("question", "sentence"), "label", ("entailment", "not_entailment")),
    "rte": GlueTask(("sentence1", "sentence2"), "label", ("entailment", "not_entailment")),
    "mnli": GlueTask(("sentence1", "sentence2"), "gold_label", ("entailment", "neutral", "contradiction"),
                     dev_file="dev_matched.tsv"),
}


@dataclass
class GlueParams:
    """Settings of the ``glue`` dataset (both paths are required)."""

    root: str = ""  # folder holding train.tsv and the dev file
    task: str = "sst2"  # one of GLUE_TASKS
    tokenizer: str = ""  # Hugging Face model/tokenizer folder (the presets use ${model.params.path})
    max_len: int = 128  # token ids per example, special tokens included
    max_train: int = 0  # keep only the first this many train rows (0 = all)
    max_dev: int = 0  # keep only the first this many dev rows (0 = all)


@dataclass
class GlueDataset(ArrayDataset):
    """An :class:`ArrayDataset` whose rows ``test_index`` are the predefined server test split."""

    test_index: np.ndarray | None = None


def _check(p: GlueParams) -> tuple[GlueTask, Path]:
    if p.task not in GLUE_TASKS:
        raise ConfigError(f"data.params.task: unknown GLUE task {p.task!r}; known: {', '.join(GLUE_TASKS)}")
    if not p.root:
        raise ConfigError("data.params.root must name the folder with the GLUE TSV files (e.g. data.params.root=/data/SST-2)")
    root = Path(p.root).expanduser()
    if not root.is_dir():
        raise ConfigError(f"data.params.root: no such directory: {p.root}")
    if not p.tokenizer:
        raise ConfigError("data.params.tokenizer must name a local Hugging Face model folder")
    if not 2 <= p.max_len <= 4096:
        raise ConfigError(f"data.params.max_len must be in [2, 4096], got {p.max_len}")
    if p.max_train < 0 or p.max_dev < 0:
        raise ConfigError("data.params.max_train and max_dev must be >= 0")
    return GLUE_TASKS[p.task], root


def read_tsv(path: Path, task: GlueTask, limit: int = 0) -> tuple[list[tuple[str, ...]], np.ndarray]:
    """``(texts, labels)`` of one GLUE TSV: one tuple of 1 or 2 strings per row, int64 labels."""
    if not path.is_file():
        raise ConfigError(f"data.params.root: missing GLUE file {path}")
    with open(path, encoding="utf-8", newline="") as fh:
        rows = list(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    cols: list[int] = []
    if task.header:
        head, rows = (rows[0] if rows else []), rows[1:]
        for name in (*task.text, task.label):
            if name not in head:
                raise ConfigError(f"{path}: no column {name!r} (header: {', '.join(head) or 'empty'})")
            cols.append(head.index(name))
    else:
        cols = [int(c) for c in (*task.text, task.label)]
    if limit:
        rows = rows[:limit]
    texts, labels = [], []
    for line, row in enumerate(rows, start=2 if task.header else 1):
        if len(row) <= max(cols):
            raise ConfigError(f"{path}:{line}: {len(row)} fields, need at least {max(cols) + 1}")
        value = row[cols[-1]].strip()
        if value not in task.labels:
            raise ConfigError(f"{path}:{line}: label {value!r} is not one of {', '.join(task.labels)}")
        texts.append(tuple(row[c] for c in cols[:-1]))
        labels.append(task.labels.index(value))
    if not texts:
        raise ConfigError(f"{path}: no examples")
    return texts, np.asarray(labels, dtype=np.int64)


@functools.lru_cache(maxsize=2)
def load_tokenizer(path: str) -> Any:
    """The tokenizer saved in a local folder (never downloaded)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not Path(path).expanduser().is_dir():
        raise ConfigError(f"data.params.tokenizer: no such directory: {path} "
                          "(the presets take it from model.params.path)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(Path(path).expanduser()), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"data.params.tokenizer: cannot load a tokenizer from {path}: {first}") from None


def encode(tokenizer: Any, texts: list[tuple[str, ...]], max_len: int) -> np.ndarray:
    """int64 ids (N, max_len): single sentences or pairs, truncated, right-padded with the pad id."""
    if tokenizer.pad_token_id is None:
        raise ConfigError("data.params.tokenizer: the tokenizer has no pad token")
    first = [t[0] for t in texts]
    second = [t[1] for t in texts] if len(texts[0]) > 1 else None
    enc = tokenizer(first, second, padding="max_length", truncation=True, max_length=max_len,
                    return_attention_mask=False, return_token_type_ids=False)
    return np.asarray(enc["input_ids"], dtype=np.int64).reshape(len(texts), max_len)


@DATASETS.register("glue", params=GlueParams,
                   summary="a GLUE task from local TSV files (train + dev as server test), local HF tokenizer")
def load_glue(params: GlueParams | None, seed: int) -> GlueDataset:
    """Train rows then dev rows as token ids; ``test_index`` marks the dev rows (``seed`` is unused)."""
    p = params or GlueParams()
    task, root = _check(p)
    train_texts, train_y = read_tsv(root / "train.tsv", task, p.max_train)
    dev_texts, dev_y = read_tsv(root / task.dev_file, task, p.max_dev)
    tok = load_tokenizer(p.tokenizer)
    x = encode(tok, train_texts + dev_texts, p.max_len)
    y = np.concatenate([train_y, dev_y])
    test_index = np.arange(len(train_y), len(y), dtype=np.int64)
    return GlueDataset(x, y, len(task.labels), f"glue_{p.task}", test_index=test_index)
