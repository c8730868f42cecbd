"""glue: GLUE-format TSVs from a local folder, tokenised with a local HF tokenizer; dev = server test."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from envs.federated import build_federated_data
from envs.glue import GLUE_TASKS, GlueParams, load_glue
from fedsim.errors import ConfigError

WORDS = ("good great fine film movie plot bad awful dull boring the a is was not very what why "
         "who does it mean sure yes no").split()
#: RoBERTa's special-token ids: pad is 1, not 0.
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")


def make_tiny_model(folder: Path, max_positions: int = 40) -> Path:
    """A random 2-layer, 32-wide RoBERTa and a word-level tokenizer over :data:`WORDS`, saved to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, RobertaConfig, RobertaModel

    vocab = {w: i for i, w in enumerate((*SPECIALS, *WORDS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", cls_token="<s>", sep_token="</s>")
    config = RobertaConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=37, max_position_embeddings=max_positions, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2)
    import torch

    with torch.random.fork_rng():  # the same weights whatever ran before in this worker
        torch.manual_seed(0)
        model = RobertaModel(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def write_tsv(path: Path, header: list[str] | None, rows: list[list[str]]) -> None:
    lines = (["\t".join(header)] if header else []) + ["\t".join(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def make_sst2(folder: Path, n_train: int = 24, n_dev: int = 8) -> Path:
    """A tiny SST-2 folder: label = 1 for the "good" sentences."""
    folder.mkdir(parents=True, exist_ok=True)
    pos, neg = "the film was very good", "the plot is dull and boring"
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        write_tsv(folder / name, ["sentence", "label"], [[pos, "1"] if i % 2 else [neg, "0"] for i in range(n)])
    return folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_roberta"))


def _params(root: Path, model: Path, **kw) -> GlueParams:
    return GlueParams(root=str(root), tokenizer=str(model), **{"max_len": 16, **kw})


def test_sst2_rows_labels_and_dev_as_test_index(tmp_path, tiny_model) -> None:
    ds = load_glue(_params(make_sst2(tmp_path / "sst2", 24, 8), tiny_model), seed=0)
    assert ds.x.shape == (32, 16) and ds.x.dtype == np.int64 and ds.num_classes == 2
    np.testing.assert_array_equal(ds.test_index, np.arange(24, 32))
    np.testing.assert_array_equal(ds.y[:4], [0, 1, 0, 1])
    first = ds.x[1]
    assert first[0] == 0 and 2 in first and first[-1] == 1  # <s> ... </s> then <pad>=1
    assert int(first[1]) == 4 + WORDS.index("the")


def test_mnli_pairs_text_labels_and_dev_matched(tmp_path, tiny_model) -> None:
    root = tmp_path / "mnli"
    root.mkdir()
    head = ["index", "genre", "sentence1", "sentence2", "gold_label"]
    rows = [[str(i), "fiction", "the film is good", "it was fine", lab]
            for i, lab in enumerate(["entailment", "neutral", "contradiction"] * 2)]
    write_tsv(root / "train.tsv", head, rows)
    write_tsv(root / "dev_matched.tsv", head, rows[:3])
    ds = load_glue(_params(root, tiny_model, task="mnli"), seed=0)
    assert ds.num_classes == 3 and len(ds) == 9
    np.testing.assert_array_equal(ds.y, [0, 1, 2, 0, 1, 2, 0, 1, 2])
    ids = list(ds.x[0])
    assert ids.count(2) == 3  # pair template <s> a </s> </s> b </s>


def test_cola_is_headerless(tmp_path, tiny_model) -> None:
    root = tmp_path / "cola"
    root.mkdir()
    rows = [["src", str(i % 2), "", "the film is good"] for i in range(4)]
    write_tsv(root / "train.tsv", None, rows)
    write_tsv(root / "dev.tsv", None, rows[:2])
    ds = load_glue(_params(root, tiny_model, task="cola"), seed=0)
    np.testing.assert_array_equal(ds.y, [0, 1, 0, 1, 0, 1])


def test_every_task_layout_names_its_columns() -> None:
    assert set(GLUE_TASKS) == {"sst2", "cola", "mrpc", "qqp", "qnli", "rte", "mnli"}
    assert GLUE_TASKS["qnli"].text == ("question", "sentence") and GLUE_TASKS["mnli"].dev_file == "dev_matched.tsv"


def test_dev_set_is_the_server_test_split(tmp_path, tiny_model) -> None:
    root = make_sst2(tmp_path / "sst2", 24, 8)
    cfg = {"name": "glue", "client_test_fraction": 0.0, "test_fraction": 0.5,
           "params": {"root": str(root), "tokenizer": str(tiny_model), "max_len": 16},
           "partition": {"name": "iid"}}
    fd = build_federated_data(cfg, num_clients=2, seed=0)
    np.testing.assert_array_equal(fd.server_test_index, np.arange(24, 32))
    assert sorted(np.concatenate(fd.train_index).tolist()) == list(range(24))


@pytest.mark.parametrize("change, message", [
    ({"root": "/no/such/glue"}, "no such directory"),
    ({"task": "squad"}, "unknown GLUE task 'squad'"),
    ({"task": "qnli"}, "no column 'question'"),
    ({"tokenizer": "/no/such/model"}, "data.params.tokenizer: no such directory"),
    ({"max_len": 1}, "data.params.max_len"),
])
def test_bad_params_are_one_line_errors(tmp_path, tiny_model, change, message) -> None:
    params = _params(make_sst2(tmp_path / "sst2"), tiny_model)
    for key, value in change.items():
        setattr(params, key, value)
    with pytest.raises(ConfigError, match=message) as err:
        load_glue(params, seed=0)
    assert "\n" not in str(err.value)


def test_missing_dev_file_and_bad_label_are_errors(tmp_path, tiny_model) -> None:
    root = make_sst2(tmp_path / "sst2")
    (root / "dev.tsv").unlink()
    with pytest.raises(ConfigError, match="missing GLUE file .*dev.tsv"):
        load_glue(_params(root, tiny_model), seed=0)
    write_tsv(root / "dev.tsv", ["sentence", "label"], [["the film", "7"]])
    with pytest.raises(ConfigError, match=r"dev.tsv:2: label '7' is not one of 0, 1"):
        load_glue(_params(root, tiny_model), seed=0)
