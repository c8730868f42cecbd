"""The text suite: three small classification tasks on ``stdlib_docs`` paragraphs, as MiniLM token ids.

The paragraphs are :func:`envs.text.stdlib_docs_texts` (docstring paragraphs of the Python standard
library, 400 per module family, the balance cap chosen by ``data_seed``), tokenised with the bundled
MiniLM WordPiece tokenizer to ``max_len`` ids (``[CLS] … [SEP]``, truncated, pad id 0).

==============  ============================================================================  =======
task            what                                                                          classes
==============  ============================================================================  =======
families04      module family among text processing, numbers, files & OS, persistence,        5
                concurrency (:data:`envs.text.STDLIB_FAMILIES` 0–4)
families59      module family among networking, internet data, dev tools, language runtime,   5
                packaging (families 5–9)
code            does the *visible* part of the paragraph (the text its first ``max_len`` ids  2
                cover) hold a code-like token: ``snake_case``, ``name(``, a backtick or a
                dotted name such as ``os.path`` (``e.g.``/``i.e.``/``etc.`` excepted)?
                Balanced by drawing equally many paragraphs of each class.
==============  ============================================================================  =======

As in the image suite, ``data_seed`` fixes each test set and ``train_seed`` draws the training set
from the remaining pool (:func:`central.combo.tasks._split_rows`).
"""

from __future__ import annotations

import functools
import re
from typing import Callable

import numpy as np
import torch

from central.combo.tasks import TaskData, _split_rows
from fedsim.errors import ConfigError

PER_CLASS = 400  # stdlib_docs paragraphs per family (its default balance cap)
CODE = re.compile(r"\w_\w|\w\(|`|\b[A-Za-z_]\w*\.[A-Za-z_]\w*")
_ABBREVIATIONS = re.compile(r"\b(e\.g|i\.e|etc|vs)\.", re.IGNORECASE)


def is_code_like(text: str) -> bool:
    """Whether ``text`` holds a code-like token (see the module docstring)."""
    return bool(CODE.search(_ABBREVIATIONS.sub(" ", text)))


@functools.lru_cache(maxsize=2)
def _docs(data_seed: int) -> tuple[tuple[str, ...], np.ndarray]:
    from envs.text import stdlib_docs_texts

    texts, labels = stdlib_docs_texts(PER_CLASS, 40, data_seed)
    labels.flags.writeable = False
    return tuple(texts), labels


def visible_prefix(texts: list[str], max_len: int) -> list[str]:
    """The part of each text that its first ``max_len`` token ids (``[CLS]``/``[SEP]`` included) cover."""
    from envs.text import minilm_tokenizer

    enc = minilm_tokenizer()(list(texts), truncation=True, max_length=max_len, return_offsets_mapping=True,
                             return_attention_mask=False, return_token_type_ids=False)
    return [text[:max((e for _, e in offsets), default=0)] for text, offsets in zip(texts, enc["offset_mapping"])]


def _task(name: str, n_classes: int, texts: list[str], y: np.ndarray, n_train: int, n_test: int, max_len: int,
          data_seed: int, train_seed: int) -> TaskData:
    from envs.text import tokenize_texts

    if n_train + n_test > len(y):
        raise ConfigError(f"params.train_per_task + params.test_per_task must be <= {len(y)} for task {name}, "
                          f"got {n_train + n_test}")
    train, test = _split_rows(len(y), n_test, n_train, data_seed, train_seed)
    ids = lambda rows: torch.from_numpy(tokenize_texts([texts[i] for i in rows], max_len))  # noqa: E731
    return TaskData(name, n_classes, ids(train), torch.as_tensor(y[train]), ids(test), torch.as_tensor(y[test]))


def _families(name: str, first: int, n_train: int, n_test: int, max_len: int, data_seed: int,
              train_seed: int) -> TaskData:
    texts, labels = _docs(data_seed)
    rows = np.flatnonzero((labels >= first) & (labels < first + 5))
    return _task(name, 5, [texts[i] for i in rows], labels[rows] - first, n_train, n_test, max_len, data_seed,
                 train_seed)


def families04(n_train: int, n_test: int, max_len: int, data_seed: int, train_seed: int) -> TaskData:
    return _families("families04", 0, n_train, n_test, max_len, data_seed, train_seed)


def families59(n_train: int, n_test: int, max_len: int, data_seed: int, train_seed: int) -> TaskData:
    return _families("families59", 5, n_train, n_test, max_len, data_seed, train_seed)


def code(n_train: int, n_test: int, max_len: int, data_seed: int, train_seed: int) -> TaskData:
    texts, _ = _docs(data_seed)
    flag = np.array([is_code_like(t) for t in visible_prefix(list(texts), max_len)])
    rng = np.random.default_rng([data_seed, 9])
    per = int(min(flag.sum(), (~flag).sum()))
    rows = np.sort(np.concatenate([rng.choice(np.flatnonzero(flag == k), per, replace=False) for k in (False, True)]))
    return _task("code", 2, [texts[i] for i in rows], flag[rows].astype(np.int64), n_train, n_test, max_len,
                 data_seed, train_seed)


#: task name -> builder(n_train, n_test, max_len, data_seed, train_seed).
TEXT_TASKS: dict[str, Callable[[int, int, int, int, int], TaskData]] = {
    "families04": families04, "families59": families59, "code": code}
#: task name -> the most examples its train + test sets may hold (``code``: 2,366 at max_len 32, checked when built).
TEXT_POOL_SIZE: dict[str, int] = {"families04": 5 * PER_CLASS, "families59": 5 * PER_CLASS}
