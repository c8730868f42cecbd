"""ComBo: token-grid alignment, relevance = projection norms, order equivariance, top-k, caching, the run."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from fedsim.central_runner import run_central
from central.combo.backbones import (BackboneRecipe, ConvNet, _objective_head, load_or_train, rotate_batch,
                                     token_features, token_grid)
from central.combo.features import FeatureBank, standardise
from central.combo.head import ComboHead, HeadRecipe, predict, top_k, train_head
from central.combo.features import TaskFeatures
from central.combo.run import ComboParams, TaskResult, check, combo_and_topk, rank_of, summarise
from central.combo.tasks import TaskData, build_task, mnist_high_halves, place
from fedsim import config as C
from fedsim.cli import main
from fedsim.errors import ConfigError
from fedsim.threads import torch_threads

@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors run fastest (and steadiest on a shared machine) on one torch thread, as in the run."""
    with torch_threads(1):
        yield


RECIPE = HeadRecipe(proj_dim=4, depth=1, heads=2, mlp_ratio=2, dropout=0.1, epochs=3, batch=16, lr=3e-3,
                    weight_decay=0.5)


def _features(n: int = 48, seed: int = 0) -> tuple[list[str], list[list[torch.Tensor]], torch.Tensor]:
    """Three synthetic backbones (2 layers each, 4 tokens); only backbone "b" carries the label."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    feats = [[torch.randn(n, 4, d, generator=g) for d in (5, 7)] for _ in range(3)]
    feats[1][0][:, :, 0] += 3.0 * y[:, None]  # signal in backbone "b"
    return ["a", "b", "c"], feats, y


# -- token grids -----------------------------------------------------------------------------------

def test_token_grid_is_a_row_major_block_average() -> None:
    fmap = torch.randn(2, 3, 8, 8)
    tokens = token_grid(fmap, 4)
    assert tokens.shape == (2, 16, 3)
    i, j = 2, 1  # token 2*4+1 averages rows 4..5, cols 2..3
    assert torch.allclose(tokens[:, i * 4 + j], fmap[:, :, 4:6, 2:4].mean(dim=(2, 3)), atol=1e-6)


def test_every_layer_of_every_backbone_lands_on_the_same_grid() -> None:
    torch.manual_seed(0)
    nets = [ConvNet((4, 8, 16)), ConvNet((2, 3, 5))]
    x = torch.randn(5, 3, 32, 32)
    for grid in (1, 2, 4):
        for net in nets:
            maps = token_features(net, x, grid, batch=2)  # batching must not matter
            assert [tuple(m.shape) for m in maps] == [(5, grid * grid, w) for w in net.widths]
            whole = token_features(net, x, grid, batch=5)
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(maps, whole))


# -- the head --------------------------------------------------------------------------------------

def test_relevance_is_the_sum_of_each_backbones_projection_norms() -> None:
    names, feats, y = _features()
    head = train_head(names, feats, y, 3, RECIPE, seed=1)
    expected = torch.zeros(3)
    for proj, (k, _) in zip(head.proj, head.slots):
        expected[k] += proj.weight.detach().norm()
    assert torch.allclose(head.relevance(), expected)
    assert len(head.proj) == 6 and head.tokens(feats).shape == (len(y), 4, 6 * RECIPE.proj_dim)


def test_relevance_is_permutation_equivariant_in_backbone_order() -> None:
    names, feats, y = _features()
    base = train_head(names, feats, y, 3, RECIPE, seed=5)
    for perm in ([2, 0, 1], [1, 2, 0], [2, 1, 0]):
        head = train_head([names[i] for i in perm], [feats[i] for i in perm], y, 3, RECIPE, seed=5)
        assert torch.equal(head.relevance(), base.relevance()[perm])
        assert torch.equal(predict(head, [feats[i] for i in perm]), predict(base, feats))
    other = train_head(names, feats, y, 3, RECIPE, seed=6)
    assert not torch.equal(other.relevance(), base.relevance())  # the seed matters, the order does not


def test_projections_are_seeded_by_backbone_identity() -> None:
    names, feats, _ = _features()
    dims = [[5, 7]] * 3
    full = ComboHead(names, dims, 4, 3, RECIPE, seed=3)
    kept = ComboHead(["c", "a"], dims[:2], 4, 3, RECIPE, seed=3)  # a top-2 retrain starts from the same maps
    by_name = {(names[k], layer): p.weight for p, (k, layer) in zip(full.proj, full.slots)}
    for p, (k, layer) in zip(kept.proj, kept.slots):
        assert torch.equal(p.weight, by_name[(["c", "a"][k], layer)])


def test_the_informative_backbone_gets_the_largest_relevance() -> None:
    names, feats, y = _features(n=96)
    recipe = HeadRecipe(proj_dim=4, heads=2, epochs=15, batch=32, lr=3e-3, weight_decay=1.0)
    head = train_head(names, feats, y, 3, recipe, seed=0)
    assert top_k(names, head.relevance(), 1) == ["b"]
    assert float((predict(head, feats) == y).float().mean()) > 0.9


def test_proj_init_scales_the_starting_projections_and_nothing_else() -> None:
    names, feats, _ = _features()
    dims = [[5, 7]] * 3
    heads = {s: ComboHead(names, dims, 4, 3, replace(RECIPE, proj_init=s), seed=3) for s in (1.0, 0.01)}
    for small, default in zip(heads[0.01].proj, heads[1.0].proj):
        assert torch.allclose(small.weight, 0.01 * default.weight) and torch.allclose(small.bias, 0.01 * default.bias)
    assert torch.allclose(heads[0.01].relevance(), 0.01 * heads[1.0].relevance())
    body = [(n, q) for n, q in heads[1.0].named_parameters() if not n.startswith("proj")]
    assert body and all(torch.equal(q, dict(heads[0.01].named_parameters())[n]) for n, q in body)


def test_with_the_default_init_the_starting_norms_swamp_the_relevance() -> None:
    """Why ``proj_init`` is small: from PyTorch's init the trained norms stay near their (equal) start."""
    names, feats, y = _features(n=96)
    recipe = HeadRecipe(proj_dim=4, heads=2, epochs=15, batch=32, lr=3e-3, weight_decay=1.0)
    spreads = {}
    for scale in (1.0, 0.01):
        head = train_head(names, feats, y, 3, replace(recipe, proj_init=scale), seed=0)
        rel = head.relevance()
        spreads[scale] = float((rel.max() - rel.min()) / rel.mean())
    assert spreads[0.01] > 3 * spreads[1.0]


def _synthetic_task(n_train: int = 120, n_test: int = 120) -> tuple[TaskData, TaskFeatures]:
    names, feats, y = _features(n=n_train + n_test, seed=4)
    split = lambda maps, a, b: [[m[a:b] for m in layer] for layer in maps]  # noqa: E731
    x = torch.zeros(n_train + n_test, 1)
    task = TaskData("synthetic", 3, x[:n_train], y[:n_train], x[n_train:], y[n_train:])
    return task, TaskFeatures(names, split(feats, 0, n_train), split(feats, n_train, n_train + n_test))


def test_the_shuffled_label_head_is_at_chance_and_the_real_one_is_not() -> None:
    task, feats = _synthetic_task()
    p = ComboParams(methods=["combo"], backbones=feats.names, null_control=True, proj_dim=4, heads=2, epochs=15,
                    batch=32, lr=3e-3)
    out = TaskResult("synthetic", n_classes=3)
    combo_and_topk(task, feats, p, seed=0, out=out)
    assert out.acc["combo"] > 0.9
    assert abs(out.acc["null_combo"] - 1 / 3) < 0.15 and out.null_relevance is not None
    assert len(out.null_relevance) == 3 and out.null_relevance != out.relevance


def test_top_k_picks_the_k_highest_scores_with_stable_ties() -> None:
    names = ["w", "x", "y", "z"]
    assert top_k(names, torch.tensor([0.5, 2.0, 1.0, 3.0]), 2) == ["z", "x"]
    assert top_k(names, torch.tensor([1.0, 2.0, 2.0, 0.0]), 3) == ["x", "y", "w"]
    assert top_k(names, torch.tensor([1.0, 2.0, 2.0, 0.0]), 4) == ["x", "y", "w", "z"]


# -- features and caching --------------------------------------------------------------------------

def test_standardise_uses_training_statistics() -> None:
    g = torch.Generator().manual_seed(0)
    train, test = 3 + 2 * torch.randn(40, 4, 3, generator=g), torch.randn(10, 4, 3, generator=g)
    train[..., 2] = 0.0  # a dead ReLU channel
    tr, te = standardise(train, test)
    flat = tr.reshape(-1, 3)
    assert torch.allclose(flat[:, :2].mean(0), torch.zeros(2), atol=1e-5)
    assert torch.allclose(flat[:, :2].std(0), torch.ones(2), atol=1e-5)
    assert torch.equal(tr[..., 2], torch.zeros(40, 4)) and torch.isfinite(te).all()


def test_feature_bank_extracts_once_and_caching_does_not_change_results() -> None:
    torch.manual_seed(0)
    nets = {"p": ConvNet((4, 8, 16)), "q": ConvNet((4, 8, 16))}
    task = build_task("shapes", 32, 16, 0, 1)
    bank = FeatureBank(nets, 2)
    first = bank.features(task)
    again = bank.features(task, ["q", "p"])
    assert bank.extractions == 2  # one pass per (task, backbone), however often it is asked
    assert all(a is b for a, b in zip(first.train[0], again.train[1]))
    fresh = []  # recomputed from the images without the bank
    for name in ("p", "q"):
        maps = token_features(nets[name], torch.cat([task.x_train, task.x_test]), 2)
        fresh.append([standardise(m[:32], m[32:]) for m in maps])
    recipe = HeadRecipe(proj_dim=4, heads=2, epochs=2, batch=8)
    cached = train_head(["p", "q"], first.train, task.y_train, 4, recipe, seed=2)
    direct = train_head(["p", "q"], [[t for t, _ in f] for f in fresh], task.y_train, 4, recipe, seed=2)
    assert torch.equal(cached.relevance(), direct.relevance())
    assert torch.equal(predict(cached, first.test), predict(direct, [[t for _, t in f] for f in fresh]))
    bank.drop(task.name)
    bank.features(task)
    assert bank.extractions == 4


def test_backbones_are_cached_on_disk_by_recipe(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDSIM_CACHE", str(tmp_path))
    recipe = BackboneRecipe("supervised", widths=(2, 4, 8), images=32, epochs=1, batch=16, seed=3)
    net, info = load_or_train(recipe)
    again, info2 = load_or_train(recipe)
    assert info["cached"] == 0.0 and info2["cached"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), again.state_dict().values()))
    assert len(list((tmp_path / "combo").glob("supervised-*.pt"))) == 1
    rand, rinfo = load_or_train(BackboneRecipe("random", widths=(2, 4, 8), seed=3))
    assert rinfo["cached"] == 0.0 and not any((tmp_path / "combo").glob("random-*"))
    assert not torch.equal(net.convs[0].weight, rand.convs[0].weight)  # same seed, same init: training moved it


def test_objective_heads_fit_the_backbone_and_rotation_labels_are_right() -> None:
    torch.manual_seed(0)
    net, x = ConvNet((2, 4, 8)), torch.randn(6, 3, 32, 32)
    last = net.layers(x)[-1]
    shapes = {"supervised": (6, 5), "rotation": (6, 4), "autoencoder": (6, 3, 32, 32)}
    for objective, shape in shapes.items():
        assert _objective_head(BackboneRecipe(objective, widths=(2, 4, 8)))(last).shape == shape
    rotated, k = rotate_batch(x, torch.Generator().manual_seed(1))
    assert len(set(k.tolist())) > 1
    for img, r, q in zip(x, rotated, k):
        assert torch.equal(torch.rot90(r, -int(q), dims=(1, 2)), img)


# -- tasks -----------------------------------------------------------------------------------------

def test_tasks_have_fixed_test_sets_and_disjoint_digit_halves() -> None:
    a, b = mnist_high_halves(0)
    assert len(set(a.tolist()) & set(b.tolist())) == 0 and len(a) == len(b) == 1250
    for name, classes in (("parity", 2), ("texture", 3), ("shapes", 4)):
        one, two = build_task(name, 20, 12, 0, 1), build_task(name, 20, 12, 0, 2)
        assert one.x_train.shape == (20, 3, 32, 32) and one.x_test.shape == (12, 3, 32, 32)
        assert one.n_classes == classes and int(one.y_train.max()) < classes
        assert torch.equal(one.x_test, two.x_test) and torch.equal(one.y_test, two.y_test)  # fixed test set
        assert not torch.equal(one.x_train, two.x_train)  # the run seed draws the training set


def test_place_keeps_the_digit_inside_the_canvas() -> None:
    digit = torch.zeros(3, 28, 28)
    digit[:, 4:24, 4:24] = 1.0
    out = place(digit, np.random.default_rng(0), scale=(0.5, 0.5))
    assert out.shape == (3, 3, 32, 32)
    mass = out[:, 0].sum(dim=(1, 2))
    assert torch.allclose(mass, mass[0].expand(3), rtol=0.05)  # same size wherever it lands
    assert float(mass[0]) == pytest.approx(20 * 20 * 0.5 ** 2, rel=0.05)  # the box's area × s²


# -- summaries -------------------------------------------------------------------------------------

def test_rank_and_random_last_fraction() -> None:
    assert rank_of([3.0, 1.0, 2.0], 1) == 3 and rank_of([3.0, 1.0, 3.0], 2) == 1
    p = ComboParams(methods=["combo"], backbones=["supervised", "random"], tasks=["shapes", "texture"])
    results = [TaskResult("shapes", {"combo": 0.8}, n_classes=4, relevance=[2.0, 1.0]),
               TaskResult("texture", {"combo": 0.6}, n_classes=2, relevance=[1.0, 3.0])]
    m = summarise(results, p)
    assert m["eval/random_rank_last_frac"] == 0.5 and m["eval/mean_acc"] == pytest.approx(0.7)
    assert m["eval/random_rank_first_frac"] == 0.5 and m["eval/relevance_rank/random"] == 1.5
    assert m["eval/chance_mean_acc"] == pytest.approx((1 / 4 + 1 / 2) / 2)
    p3 = ComboParams(methods=["combo"], backbones=["supervised", "rotation", "random"], tasks=["shapes", "texture"])
    three = [TaskResult("shapes", {"combo": 0.8}, relevance=[2.0, 1.0, 1.5]),  # random in the middle
             TaskResult("texture", {"combo": 0.6}, relevance=[1.0, 3.0, 0.5])]  # random last
    m3 = summarise(three, p3)
    assert m3["eval/random_rank_last_frac"] == 0.5 and m3["eval/random_rank_first_frac"] == 0.0
    assert "eval/chance_mean_acc" not in m3  # classes unknown: no chance level
    tied = [TaskResult("shapes", {"combo": 0.8}, relevance=[1.0, 2.0, 1.0]),  # a tie is not "last"
            TaskResult("texture", {"combo": 0.6}, relevance=[2.0, 1.0, 2.0])]  # nor "first"
    mt = summarise(tied, p3)
    assert mt["eval/random_rank_last_frac"] == 0.0 and mt["eval/random_rank_first_frac"] == 0.0


# -- the run ---------------------------------------------------------------------------------------

TINY = ["params.methods=[combo,topk,single,probe,concat_probe]", "params.backbones=[supervised,random]", "params.tasks=[shapes,texture]", "params.train_per_task=40",
        "params.test_per_task=24", "params.widths=[2,4,8]", "params.pretrain_images=48", "params.pretrain_epochs=1",
        "params.proj_dim=4", "params.heads=2", "params.epochs=2", "params.batch=16", "params.top_k=1",
        "params.probe_cs=[0.1]", "params.grid=2", "params.null_control=true"]


def test_same_seed_gives_identical_metrics_and_logs_tables(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDSIM_CACHE", str(tmp_path))
    cfg = C.load_central_config("combo", TINY)
    cfg.tracking.enabled = False
    first, second = run_central(cfg), run_central(cfg)
    assert first.metrics == second.metrics
    m = first.metrics
    for key in ("eval/combo_mean_acc", "eval/topk_mean_acc", "eval/best_probe_mean_acc", "eval/concat_probe_mean_acc",
                "eval/random_rank_last_frac", "eval/random_rank_first_frac", "eval/oracle_probe_mean_acc",
                "eval/null_relevance_spread", "eval/null_combo_mean_acc"):
        assert key in m and 0.0 <= m[key] <= 1.0
    assert m["eval/chance_mean_acc"] == pytest.approx((1 / 4 + 1 / 3) / 2)  # shapes: 4 classes, texture: 3
    assert m["eval/mean_acc"] == m["eval/combo_mean_acc"]
    assert m["eval/best_single_combo_mean_acc"] == max(m["eval/single_combo_mean_acc/supervised"],
                                                       m["eval/single_combo_mean_acc/random"])
    assert m["eval/best_probe_mean_acc"] <= m["eval/oracle_probe_mean_acc"]
    assert [r["task"] for r in first.tables["accuracy"]] == ["shapes", "texture", "mean"]
    assert len(first.tables["relevance"]) == 2 and len(first.tables["probes"]) == 2 * 3
    assert all(r["kept"] in ("supervised", "random") for r in first.tables["relevance"])
    other = run_central(C.load_central_config("combo", TINY, seed=1))
    assert other.metrics != first.metrics


@pytest.mark.parametrize("bad", [
    {"methods": []}, {"methods": ["combo", "lora"]}, {"backbones": ["supervised", "supervised"]},
    {"backbones": ["clip"]}, {"methods": ["single", "single"]}, {"tasks": ["cifar"]}, {"train_per_task": 5}, {"train_per_task": 900},
    {"test_per_task": 0}, {"grid": 5}, {"grid": 0}, {"top_k": 0}, {"top_k": 5}, {"heads": 5}, {"epochs": 0},
    {"lr": 0.0}, {"weight_decay": -1.0}, {"dropout": 1.0}, {"probe_layer": "first"}, {"probe_cs": [0.0]},
    {"val_frac": 0.9}, {"widths": [4, 8]}, {"pretrain_images": 3000}, {"proj_init": 0.0},
])
def test_bad_params_give_a_one_line_config_error(bad: dict) -> None:
    with pytest.raises(ConfigError) as err:
        check(ComboParams(**bad))
    assert "\n" not in str(err.value)


def test_default_params_pass_the_check() -> None:
    check(ComboParams())
    cfg = C.load_central_config("combo")
    check(ComboParams(**cfg.params))


SPEC_TINY = ["params.train_per_task=40", "params.test_per_task=24", "params.widths=[2,4,8]",
             "params.pretrain_images=48", "params.pretrain_epochs=1", "params.proj_dim=4", "params.heads=2",
             "params.epochs=2", "params.batch=16", "params.probe_cs=[0.1]", "params.grid=2",
             "params.tasks=[digits59,texture]"]


def test_claim_spec_reads_every_child_and_the_children_log_what_it_reads(tmp_path, monkeypatch) -> None:
    from fedsim import reproduce
    from fedsim.central_runner import method_params

    monkeypatch.setenv("FEDSIM_CACHE", str(tmp_path))
    spec = reproduce.load_claim("combo")
    assert spec.has_protocol and spec.metric == "eval/mean_acc" and len(spec.seeds) >= 3
    comparisons = [*spec.claim, *spec.controls.positive]
    kinds = {c.kind for c in spec.claim}
    assert kinds == {"superiority", "equivalence"} and any(c.against_constant for c in spec.claim)
    settings = reproduce.settings(spec)
    assert {s["params.proj_init"] for s in settings} == {0.01, 1.0}
    for setting in settings:
        readers = [c for c in comparisons if all(setting.get(k) == v for k, v in {**c.at, **c.better}.items())]
        assert readers, f"no verdict or control reads {setting}"
        check(method_params(reproduce.build_config(spec, setting, 0)))  # the full-size child is valid
        cfg = reproduce.build_config(spec, setting, 0, SPEC_TINY)
        cfg.tracking.enabled = False
        logged = set(run_central(cfg).metrics)
        wanted = {m for c in readers for m in c.metrics(spec.metric)}
        assert wanted <= logged, sorted(wanted - logged)
    assert 0.0 < spec.controls.floor.value < spec.controls.ceiling.value < 1.0


def test_cli_rejects_bad_params_in_one_line(capsys) -> None:
    assert main(["run", "combo", "params.top_k=7", "--no-tracking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "top_k" in err[0]


# -- the text setting ------------------------------------------------------------------------------

def _tiny_bert_config():
    from transformers import BertConfig

    return BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=6, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=64, attn_implementation="eager")


def _tiny_bert(seed: int):
    from transformers import AutoModel

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModel.from_config(_tiny_bert_config(), attn_implementation="eager").eval()


@pytest.fixture
def tiny_text_models(monkeypatch):
    """Swap MiniLM (pretrained and random) for tiny random BERTs with its vocabulary; the caches are cleared."""
    from central.combo import text

    text.clear_caches()
    pretrained = _tiny_bert(123)
    monkeypatch.setattr(text, "pretrained_minilm", lambda: pretrained)
    monkeypatch.setattr(text, "minilm_config", _tiny_bert_config)
    yield text
    text.clear_caches()


def _ids(n: int = 7, length: int = 12, seed: int = 0) -> torch.Tensor:
    """Token ids with [CLS]=101 … [SEP]=102 and right padding (pad id 0); row lengths 3..length."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(n, length, dtype=torch.int64)
    for i in range(n):
        m = 3 + i * (length - 3) // max(1, n - 1)
        ids[i, :m] = torch.randint(1000, 30000, (m,), generator=g)
        ids[i, 0], ids[i, m - 1] = 101, 102
    return ids


def test_chunk_pool_averages_contiguous_chunks_of_each_rows_own_length() -> None:
    from central.combo.text import chunk_pool

    states = torch.arange(6, dtype=torch.float32).reshape(1, 6, 1).repeat(2, 1, 1)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    out = chunk_pool(states, mask, 2)
    assert out.shape == (2, 2, 1)
    assert out[0, :, 0].tolist() == [1.0, 4.0]  # (0+1+2)/3, (3+4+5)/3
    assert out[1, :, 0].tolist() == [0.5, 2.5]  # the padding (4, 5) never enters


def test_text_features_have_token_grid_shapes_and_ignore_batch_size(tiny_text_models) -> None:
    text = tiny_text_models
    ids = _ids()
    maps = text.extract("minilm", ids, 4, seed=0)
    assert [tuple(m.shape) for m in maps] == [(7, 4, 16)] * 3
    assert [tuple(m.shape) for m in text.extract("bag", ids, 4, seed=0)] == [(7, 4, 16)]
    small = text.encoder_maps(text.pretrained_minilm(), ids, 4, batch=2)
    for a, b in zip(maps, small):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    alone = text.encoder_maps(text.pretrained_minilm(), ids[3:4], 4)  # a row's features do not see its batch
    torch.testing.assert_close(alone[1], maps[1][3:4], atol=1e-5, rtol=1e-5)
    rand = text.extract("random_minilm", ids, 4, seed=0)
    assert not torch.allclose(rand[-1], maps[-1])
    torch.testing.assert_close(text.extract("random_minilm", ids, 4, seed=0)[-1], rand[-1], atol=0, rtol=0)
    assert not torch.allclose(text.extract("random_minilm", ids, 4, seed=1)[-1], rand[-1])
    cached = text.cached_maps("minilm", ids, 4, seed=0)
    assert text.cached_maps("minilm", ids, 4, seed=5)[0] is cached[0]  # the pretrained model ignores the seed


def test_code_like_labels() -> None:
    from central.combo.text_tasks import is_code_like

    assert is_code_like("Call os.path.join first.") and is_code_like("the max_len value")
    assert is_code_like("Use `spam` here.") and is_code_like("calls getregentry() once")
    assert not is_code_like("Return the value, e.g. the first one, i.e. the head.")


TEXT_TINY = ["params.setting=text", "params.methods=[combo,topk,probe,concat_probe]", "params.train_per_task=40",
             "params.test_per_task=24", "params.max_len=16", "params.text_tokens=2", "params.proj_dim=4",
             "params.heads=2", "params.epochs=2", "params.batch=16", "params.probe_cs=[0.1]"]


def _shape_of(key: str, names: list[str]) -> str:
    """A metric key with its backbone and task names replaced by a placeholder."""
    return "/".join("<name>" if part in names else part for part in key.split("/"))


def test_text_setting_runs_with_the_same_metric_keys(tiny_text_models, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDSIM_CACHE", str(tmp_path))
    cfg = C.load_central_config("combo", TEXT_TINY)
    cfg.tracking.enabled = False
    res = run_central(cfg)
    m = res.metrics
    assert [r["task"] for r in res.tables["accuracy"]] == ["families04", "families59", "code", "mean"]
    assert set(m) >= {f"eval/relevance_rank/{n}" for n in ("minilm", "random_minilm", "bag")}
    assert 0.0 <= m["eval/random_rank_last_frac"] <= 1.0 and m["eval/mean_acc"] == m["eval/combo_mean_acc"]
    shared = [o for o in TEXT_TINY[1:] if not o.startswith(("params.max_len", "params.text_tokens"))]
    vision = C.load_central_config("combo", shared + [
        "params.backbones=[supervised,rotation,random]", "params.tasks=[shapes,texture]", "params.widths=[2,4,8]",
        "params.pretrain_images=48", "params.pretrain_epochs=1", "params.grid=2"])
    vision.tracking.enabled = False
    vm = run_central(vision).metrics
    text_names = ["minilm", "random_minilm", "bag", "families04", "families59", "code"]
    vision_names = ["supervised", "rotation", "random", "shapes", "texture"]
    assert {_shape_of(k, text_names) for k in m} == {_shape_of(k, vision_names) for k in vm}


def test_text_params_resolve_and_check() -> None:
    from central.combo.run import resolve

    assert resolve(ComboParams()).backbones == ["supervised", "rotation", "autoencoder", "random"]
    p = resolve(ComboParams(setting="text"))
    assert p.backbones == ["minilm", "random_minilm", "bag"] and p.tasks == ["families04", "families59", "code"]
    check(ComboParams(setting="text"))
    for bad in ({"setting": "audio"}, {"setting": "text", "backbones": ["supervised"]},
                {"setting": "text", "tasks": ["digits59"]}, {"setting": "text", "text_tokens": 0},
                {"setting": "text", "max_len": 600}, {"setting": "text", "heads": 3},
                {"setting": "text", "train_per_task": 1900, "tasks": ["families04"]},
                {"backbones": ["minilm"]}):
        with pytest.raises(ConfigError) as err:
            check(ComboParams(**bad))
        assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parallel
def test_real_minilm_features_and_the_random_control() -> None:
    from central.combo import text
    from envs.text import tokenize_texts

    text.clear_caches()
    ids = torch.from_numpy(tokenize_texts(["Return the path joined with os.sep.", "Spawn a worker thread.",
                                           "Parse an e-mail message from a bytes object."], 32))
    pre = text.extract("minilm", ids, 4, seed=0)
    assert [tuple(m.shape) for m in pre] == [(3, 4, 384)] * 3
    assert [tuple(m.shape) for m in text.extract("bag", ids, 4, seed=0)] == [(3, 4, 384)]
    torch.testing.assert_close(text.encoder_maps(text.pretrained_minilm(), ids, 4, batch=1)[2], pre[2],
                               atol=1e-4, rtol=1e-4)
    rand = text.extract("random_minilm", ids, 4, seed=0)
    assert [tuple(m.shape) for m in rand] == [(3, 4, 384)] * 3
    for a, b in zip(pre, rand):
        assert (a - b).abs().mean() > 0.1 * a.abs().mean()
    text.clear_caches()
