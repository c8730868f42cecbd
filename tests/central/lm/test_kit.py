"""The shared LM kit: corpus split, BPE vocabularies, cached tiny LMs, SmolLM2 offline."""

from __future__ import annotations

import pytest
import torch

from central.lm import tiny
from central.lm.corpus import load_corpus, stdlib_files
from central.lm.tokenizer import decode, encode, token_texts, train_bpe


def test_corpus_is_fixed_and_split_by_file() -> None:
    a, b = load_corpus(), load_corpus()
    assert a == b and len(stdlib_files()) > 500
    assert not set(a.train_files) & set(a.heldout_files)
    assert len(a.train_files) + len(a.heldout_files) == len(stdlib_files())
    assert all("test" not in p.parts for p in a.train_files)
    assert load_corpus(seed=1).heldout_files != a.heldout_files


def test_two_vocabularies_differ_and_round_trip() -> None:
    small, big = train_bpe(512), train_bpe(4096)
    assert small.get_vocab_size() == 512 and big.get_vocab_size() == 4096
    text = "def __init__(self, *args, **kwargs):\n    return None  # ünïcode"
    assert decode(small, encode(small, text)) == text == decode(big, encode(big, text))
    assert len(encode(big, text)) < len(encode(small, text))
    assert set(token_texts(big)) - set(token_texts(small))  # merges the small vocabulary lacks


def test_tiny_lm_learns_and_is_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDSIM_CACHE", str(tmp_path))
    spec = tiny.preset("test")
    steps: list[float] = []
    model, card = tiny.load_or_train(spec, on_step=lambda i, loss: steps.append(loss))
    assert len(steps) == spec.steps and sum(steps[-5:]) / 5 < sum(steps[:5]) / 5 - 0.5
    assert card["heldout_loss"] < 6.2 < float(torch.log(torch.tensor(512.0)))  # better than uniform (6.24)
    again, card2 = tiny.load_or_train(spec, on_step=lambda i, loss: pytest.fail("retrained"))
    x = torch.randint(0, spec.vocab_size, (2, 16))
    assert torch.equal(model(input_ids=x).logits, again(input_ids=x).logits) and card2 == card


@pytest.mark.slow
@pytest.mark.parallel
def test_smollm2_loads_offline_and_decodes_greedily() -> None:
    from central.lm.smollm import load_smollm2

    model, tok = load_smollm2()
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    ids = tok("def add(a, b):\n    return", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:]).strip().startswith("a")


class _Recorder:
    """A ``ctx.progress``-style factory that records what it was asked to show."""

    def __init__(self) -> None:
        self.bars: list[tuple[int, str]] = []
        self.advanced = 0

    def __call__(self, total: int, description: str) -> "_Recorder":
        self.bars.append((total, description))
        return self

    def __enter__(self) -> "_Recorder":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        self.advanced += n


def test_a_cold_cache_logs_and_reports_progress_and_a_warm_one_does_not(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(tiny, "cache_dir", lambda: tmp_path)  # cold model cache; tokenizers stay shared
    spec = tiny.preset("test", steps=4)
    bar = _Recorder()
    with caplog.at_level("WARNING", logger="fedsim.lm"):
        tiny.load_or_train(spec, progress=bar, name="unit tiny")
    assert bar.bars == [(4, "pre-training unit tiny")] and bar.advanced == 4
    first = caplog.records[0].getMessage()
    assert "unit tiny: pre-training" in first and "4 steps" in first and str(tmp_path) in first and "about" in first
    caplog.clear()
    warm = _Recorder()
    with caplog.at_level("WARNING", logger="fedsim.lm"):
        tiny.load_or_train(spec, progress=warm)
    assert warm.bars == [] and warm.advanced == 0 and not caplog.records


def test_the_builtin_bar_shows_steps_and_an_eta() -> None:
    bar = tiny._progress_factory(True)(10, "pre-training x")
    columns = [type(c).__name__ for c in bar._bar.columns]
    assert "MofNCompleteColumn" in columns and "TimeRemainingColumn" in columns
    assert tiny._progress_factory(False) is None
