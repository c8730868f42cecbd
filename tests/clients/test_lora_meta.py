"""The LoRA-ML learner: LoRA banks start as the base, per-sample adapters, only the adapter trains at
adaptation, node-local adapters across rounds, Reptile's interpolated reply, seeds, end to end."""

from __future__ import annotations

import pytest
import torch
from flwr.app import RecordDict

from fedsim.contracts.learner import NodeContext
from clients.lora_meta import STATE_KEY, LoraMetaLearner
from clients.lora_meta_model import LoraMixer, MultiLoraLinear, build
from fedsim import config as C
from fedsim.engine.runtime import RunSpec, get_learner
from fedsim.errors import ConfigError
from fedsim.runner import run_experiment

TINY = ["client.params.dataset=digits", "client.params.train_pairs=[[0,1],[2,3]]", "client.params.new_pair=[4,5]",
        "client.params.hidden=[16]", "client.params.local_steps=3", "client.params.batch_size=16",
        "client.params.shots=4", "client.params.ft_steps=5", "client.params.ft_repeats=1",
        "client.params.curve_points=[0,5]", "client.params.dim=8", "client.params.patch=4"]


def cfg_of(*overrides: str, rounds: int = 2, clients: int = 1) -> C.ExperimentConfig:
    cfg = C.load_config("peft_meta", [*TINY, *overrides], {"rounds": rounds, "clients": clients})
    cfg.tracking.enabled = False
    cfg.engine.checkpoint = False
    return cfg


def learner_of(*overrides: str, rounds: int = 2, clients: int = 1) -> LoraMetaLearner:
    learner = get_learner(RunSpec.from_config(cfg_of(*overrides, rounds=rounds, clients=clients)))
    learner.preflight()
    return learner


def _perturb_adapters(model: torch.nn.Module, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.adapter_parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


# -- the model ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["mlp", "mixer"])
def test_fresh_adapters_leave_the_base_function_unchanged(arch: str) -> None:
    """B = 0 at start: whatever the slot (and the random A), the model computes the plain base network."""
    with_slots = build(arch, (1, 8, 8), 2, 1, 3, seed=0, hidden=[16, 16], patch=4, dim=8, depth=1)
    plain = build(arch, (1, 8, 8), 2, 1, 0, seed=0, hidden=[16, 16], patch=4, dim=8, depth=1)
    with_slots.reset_adapters([5, 6, 7])
    assert with_slots.base_state().keys() == plain.base_state().keys()
    assert all(torch.equal(v, plain.base_state()[k]) for k, v in with_slots.base_state().items())
    assert all(float(layer.lora_a.detach().abs().sum()) > 0 and float(layer.lora_b.detach().abs().sum()) == 0
               for layer in with_slots.lora_layers())
    x = torch.randn(6, 1, 8, 8)
    slot = torch.tensor([0, 1, 2, 0, 1, 2])
    assert torch.allclose(with_slots(x, slot), plain(x), atol=1e-6)
    _perturb_adapters(with_slots)
    assert not torch.allclose(with_slots(x, slot), plain(x), atol=1e-3)  # the adapters are in the path


def test_every_sample_goes_through_its_own_tasks_adapter() -> None:
    layer = MultiLoraLinear(5, 3, rank=2, slots=2)
    layer.reset_adapters()
    with torch.no_grad():
        layer.lora_b.normal_()
    x = torch.randn(4, 5)
    for slot in (torch.tensor([1, 0, 0, 1]), torch.tensor([0, 0, 1, 1])):  # mixed; one chunk per task (batched)
        out = layer(x, slot)
        for i in range(4):
            s = int(slot[i])
            w = layer.weight + layer.lora_b[s] @ layer.lora_a[s]
            assert torch.allclose(out[i], w @ x[i] + layer.bias, atol=1e-5)
    # a mixer feeds (n, tokens, features): each sample's rows share its slot
    xs = torch.randn(2, 7, 5)
    out3 = layer(xs, torch.tensor([0, 1]))
    assert torch.allclose(out3[1], layer(xs[1], torch.ones(7, dtype=torch.long)), atol=1e-5)


def test_mixer_patches_follow_the_authors_rearrange() -> None:
    """'b c (h p1) (w p2) -> b (h w) (p1 p2 c)': patch (i, j) holds rows i·p.., columns j·p.."""
    m = LoraMixer((2, 4, 4), patch=2, dim=3, depth=0, token_expansion=4, channel_expansion=0.5, num_classes=2,
                  rank=1, slots=0)
    x = torch.arange(32, dtype=torch.float32).view(1, 2, 4, 4)
    seen = {}
    m.embed.register_forward_hook(lambda mod, inp, out: seen.update(x=inp[0]))  # returns None: output kept
    m(x)
    expected = torch.stack([x[0, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2].permute(1, 2, 0).reshape(-1)
                            for i in range(2) for j in range(2)])
    assert torch.equal(seen["x"][0], expected)


# -- the learner --------------------------------------------------------------------------------------------

def test_tasks_are_balanced_pairs_and_nodes_hold_them() -> None:
    central = learner_of()
    assert central.node_tasks(0) == [0, 1]
    assert len({len(t.y_train) for t in central.tasks}) == 1  # equal sizes: FedAvg weights tasks equally
    assert central.tasks[1].pair == (2, 3) and set(central.tasks[1].y_train.tolist()) == {0, 1}
    fed = learner_of(clients=2)
    assert [fed.node_tasks(0), fed.node_tasks(1)] == [[0], [1]]
    shots = central.shots(0)
    assert len(shots) == 4 and central.new_task.y_train[shots].sum() == 2  # balanced
    assert (shots == learner_of("client.params.method=retrain").shots(0)).all()  # the same for every method


def test_adaptation_trains_only_the_fresh_adapter() -> None:
    learner = learner_of("client.params.ft_steps=4", "client.params.curve_points=[0,4]")
    arrays = learner.init_arrays()
    model, out = learner.fit_new_lora(arrays, 0)
    assert all(torch.equal(v, arrays[k]) for k, v in model.base_state().items())  # base frozen
    assert any(float(layer.lora_b.detach().abs().sum()) > 0 for layer in model.lora_layers())  # the adapter moved
    assert model.slots == 1 and set(out) >= {"acc", "loss", "acc_step0", "acc_step4"}
    # step 0 is the base alone: its accuracy is that of the plain network on the new task's test images
    plain = learner.model(0)
    plain.load_part(arrays)
    with torch.no_grad():
        acc = float((plain(learner.new_task.x_test).argmax(1) == learner.new_task.y_test).float().mean())
    assert out["acc_step0"] == pytest.approx(acc)


def test_federated_adapters_stay_on_the_node_across_rounds() -> None:
    learner = learner_of(clients=2)
    arrays = learner.init_arrays()
    states = [RecordDict(), RecordDict()]
    first = [learner.train(arrays, NodeContext(p, 2, 1, 0, states[p])) for p in range(2)]
    assert all(set(r.arrays) == set(arrays) for r in first)  # the reply is the base only
    adapters = [s[STATE_KEY].to_torch_state_dict() for s in states]
    assert all(v.shape[0] == 1 for v in adapters[0].values())  # one task, one slot per node
    assert not torch.equal(adapters[0]["embed.lora_a"], adapters[1]["embed.lora_a"])  # each its own
    # round 2 starts from the node's own adapters (not fresh ones) ...
    model = learner._node_model(arrays, NodeContext(0, 2, 2, 0, states[0]), [0])
    assert all(torch.equal(v, adapters[0][k]) for k, v in model.adapter_state().items())
    again = learner.train(first[0].arrays, NodeContext(0, 2, 2, 0, states[0]))
    fresh = learner.train(first[0].arrays, NodeContext(0, 2, 2, 0, RecordDict()))
    assert any(not torch.equal(again.arrays[k], fresh.arrays[k]) for k in arrays)  # ... which matters
    assert not torch.equal(states[0][STATE_KEY].to_torch_state_dict()["embed.lora_b"], adapters[0]["embed.lora_b"])
    # client-side evaluation: the node's own test images through its own adapter
    ev = learner.evaluate(again.arrays, NodeContext(0, 2, 2, 0, states[0]))
    bare = learner.evaluate(again.arrays, NodeContext(0, 2, 2, 0, RecordDict()))
    assert ev.num_examples == len(learner.tasks[0].y_test) and set(ev.metrics) == {"acc", "loss"}
    assert ev.metrics["loss"] != bare.metrics["loss"]
    # centralised: one node, one adapter per task, each task's start the same as on its federated node
    central = learner_of()
    m = central._node_model(arrays, None, [0, 1])
    f = learner._node_model(arrays, None, [1])
    assert torch.equal(m.adapter_state()["embed.lora_a"][1], f.adapter_state()["embed.lora_a"][0])


def test_reptile_reply_is_the_interpolated_outer_step() -> None:
    full = learner_of("client.params.method=reptile", "client.params.reptile_lr=1.0", rounds=4)
    half = learner_of("client.params.method=reptile", "client.params.reptile_lr=0.5", rounds=4)
    arrays = full.init_arrays()
    a = full.train(arrays, NodeContext(0, 1, 1, 0, RecordDict())).arrays
    b = half.train(arrays, NodeContext(0, 1, 1, 0, RecordDict())).arrays
    for k in arrays:  # θ + ε·mean_t(θ_t − θ): the same inner runs, half the step
        assert torch.allclose(b[k] - arrays[k], 0.5 * (a[k] - arrays[k]), atol=1e-6)
    assert full.reptile_step_size(1) == 1.0 and full.reptile_step_size(3) == pytest.approx(0.5)


@pytest.mark.parametrize("override, clients", [
    ("client.params.new_pair=[3,2]", 1), ("client.params.shots=3", 1), ("client.params.method=maml", 1),
    ("client.params.curve_points=[0,50]", 1), ("client.params.arch=mixer", 1), ("client.params.rank=0", 1),
    ("client.params.method=lora_ml", 3)])
def test_bad_params_are_one_line_config_errors(override: str, clients: int) -> None:
    extra = ["client.params.patch=3"] if "mixer" in override else []
    with pytest.raises(ConfigError) as err:
        learner_of(override, *extra, clients=clients)
    assert "\n" not in str(err.value)


# -- end to end ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method, clients", [("lora_ml", 1), ("lora_ml", 2), ("reptile", 2)])
def test_runs_end_to_end_and_same_seed_same_history(method: str, clients: int) -> None:
    cfg = cfg_of(f"client.params.method={method}", clients=clients)
    first, again = run_experiment(cfg), run_experiment(cfg)
    assert first.history.as_rows() == again.history.as_rows()
    final = first.history.final()
    for key in ("eval/new_task_acc", "eval/new_task_acc_before", "eval/new_task_acc_step5", "eval/train_tasks_acc",
                "train/loss", "new_task/acc_final", "new_task/acc_last3"):
        assert key in final, key
    assert final["new_task/acc_final"] == final["eval/new_task_acc"]
    assert set(first.final_arrays) == set(get_learner(RunSpec.from_config(cfg)).init_arrays())  # no adapters travel
    assert len(first.history.records[-1].client_metrics) == clients
    other = run_experiment(cfg_of(f"client.params.method={method}", "seed=1", clients=clients))
    assert other.history.as_rows() != first.history.as_rows()


def test_final_report_summarises_the_rounds_and_plots(tmp_path) -> None:
    cfg = cfg_of("client.params.ft_steps=30", "client.params.curve_points=[0,30]", "client.params.local_steps=10",
                 rounds=3)
    summary = run_experiment(cfg)
    learner = get_learner(RunSpec.from_config(cfg))
    metrics, files = learner.final_report(summary.history, tmp_path)
    accs = [r.metrics["eval/new_task_acc"] for r in summary.history.records]
    assert len(set(accs)) == 4  # (so that the summaries below are distinguishable)
    assert metrics["new_task/acc_round0"] == accs[0] and metrics["new_task/acc_final"] == accs[-1]
    assert metrics["new_task/acc_mean_rounds"] == pytest.approx(sum(accs[1:]) / 3)
    assert metrics["new_task/acc_best_round"] == max(accs[1:])
    assert [f.name for f in files] == ["lora_meta_new_task.png"] and files[0].stat().st_size > 0


# -- the MiniLM text variant (stdlib_docs family pairs) -----------------------------------------------------------

TEXT_TINY = ["client.params.max_len=16", "client.params.per_class=20", "client.params.local_steps=2",
             "client.params.batch_size=2", "client.params.shots=4", "client.params.ft_steps=2",
             "client.params.ft_repeats=1", "client.params.curve_points=[0,2]",
             "client.params.train_pairs=[[0,1],[2,3]]"]


def text_cfg_of(*overrides: str, rounds: int = 1, clients: int = 1) -> C.ExperimentConfig:
    cfg = C.load_config("peft_meta_text", [*TEXT_TINY, *overrides], {"rounds": rounds, "clients": clients})
    cfg.tracking.enabled = False
    cfg.engine.checkpoint = False
    return cfg


@pytest.fixture(autouse=False)
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(min(old, 2))
    yield
    torch.set_num_threads(old)


@pytest.mark.slow  # 1-13 s (12.8 s at load ~4): the first MiniLM encoder load in the process
@pytest.mark.parallel
def test_minilm_fresh_adapter_leaves_the_output_unchanged(two_threads) -> None:
    """B = 0: the MiniLM model with adapter slots computes the plain one, whatever the slot; only the
    wrapped query/value projections and the head are base (the rest of the encoder is frozen, not exchanged)."""
    with_slots = build("minilm", (8,), 2, 1, 3, seed=0, hidden=[], patch=1, dim=1, depth=0)
    plain = build("minilm", (8,), 2, 1, 0, seed=0, hidden=[], patch=1, dim=1, depth=0)
    with_slots.reset_adapters([5, 6, 7])
    base = with_slots.base_state()
    assert base.keys() == plain.base_state().keys()
    assert all(torch.equal(v, plain.base_state()[k]) for k, v in base.items())
    assert len(base) == 2 * (2 * 6 + 1) and all(k.endswith(("query.weight", "query.bias", "value.weight",
                                                             "value.bias")) or k.startswith("head.") for k in base)
    assert all(not q.requires_grad for k, q in with_slots.named_parameters()
               if k not in base and not k.endswith(("lora_a", "lora_b")))  # the rest of the encoder: frozen
    x = torch.randint(1000, 5000, (3, 8))
    x[0, 5:] = 0  # padding
    slot = torch.tensor([0, 1, 2])
    with torch.no_grad():
        assert torch.allclose(with_slots(x, slot), plain(x), atol=1e-5)
        _perturb_adapters(with_slots, 0.05)
        assert not torch.allclose(with_slots(x, slot), plain(x), atol=1e-4)
        # per-sample adapters inside the encoder: sample 1 through slot 1 alone = the same sample in a mixed batch
        assert torch.allclose(with_slots(x[1:2], torch.tensor([1])), with_slots(x, slot)[1:2], atol=1e-5)


@pytest.mark.slow  # 3.5-18 s (18 s at load ~4): builds the stdlib_docs set (parse + tokenise) the first time
@pytest.mark.parallel
def test_minilm_tasks_are_token_ids_and_adaptation_trains_only_the_fresh_adapter(two_threads) -> None:
    learner = get_learner(RunSpec.from_config(text_cfg_of()))
    learner.preflight()
    task = learner.tasks[0]
    assert task.x_train.dtype == torch.int64 and task.x_train.shape[1:] == (16,) and task.pair == (0, 1)
    assert learner.num_classes == 10 and len(learner.new_task.y_test) == 20  # half of 2 x 20 paragraphs
    arrays = learner.init_arrays()
    frozen_before = {k: v.clone() for k, v in learner.model(1).state_dict().items()
                     if k not in arrays and not k.endswith(("lora_a", "lora_b"))}
    model, out = learner.fit_new_lora(arrays, 0)
    assert all(torch.equal(v, arrays[k]) for k, v in model.base_state().items())  # base frozen
    assert all(torch.equal(model.state_dict()[k], v) for k, v in frozen_before.items())  # encoder untouched
    assert model.slots == 1 and set(out) >= {"acc", "loss", "acc_step0", "acc_step2"}
    moved = [layer for layer in model.lora_layers() if float(layer.lora_b.detach().abs().sum()) > 0]
    assert len(moved) == len(model.lora_layers()) == 13  # 6 x (query, value) + head: the fresh adapter trained


@pytest.mark.parametrize("override, clients", [
    ("client.params.new_pair=[8,10]", 1), ("client.params.arch=mixer", 1), ("client.params.max_len=1", 1)])
def test_minilm_bad_params_are_one_line_config_errors(override: str, clients: int) -> None:
    with pytest.raises(ConfigError) as err:
        get_learner(RunSpec.from_config(text_cfg_of(override, clients=clients))).preflight()
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parallel
def test_minilm_text_variant_runs_end_to_end_and_same_seed_same_history(two_threads) -> None:
    cfg = text_cfg_of()
    first, again = run_experiment(cfg), run_experiment(cfg)
    assert first.history.as_rows() == again.history.as_rows()
    final = first.history.final()
    for key in ("eval/new_task_acc", "eval/new_task_acc_before", "eval/new_task_acc_step2", "eval/new_task_loss",
                "eval/train_tasks_acc", "train/loss", "new_task/acc_final"):
        assert key in final, key
    assert set(first.final_arrays) == set(get_learner(RunSpec.from_config(cfg)).init_arrays())  # no adapters travel
