"""``fedsim run-app PATH``: a Flower quickstart-style PyTorch app, written here, runs on fedsim's engines.

The app is what ``flwr new`` (PyTorch template) gives, shrunk to run in seconds offline: a tiny MLP on
scikit-learn's digits, partitioned by ``partition-id``; a ServerApp with Flower's message-API
``FedAvg().start(...)`` and a ClientApp with ``@app.train()`` / ``@app.evaluate()``.  Nothing of it
is mocked: the CLI reads its pyproject, imports its modules and runs its ServerApp on the engine.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from mlflow import MlflowClient

from fedsim.cli import main
from fedsim.errors import RunFailedError
from fedsim.run_app import EXPERIMENT, merge_run_config, run_app

pytestmark = pytest.mark.usefixtures("one_thread")

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{name}"
version = "1.0.0"
description = "A quickstart-style Flower app (PyTorch, offline digits)"
license = "Apache-2.0"
dependencies = ["flwr[simulation]", "torch", "scikit-learn"]

[tool.hatch.build.targets.wheel]
packages = ["{pkg}"]

[tool.flwr.app]
publisher = "tests"

[tool.flwr.app.components]
serverapp = "{pkg}.server_app:app"
clientapp = "{pkg}.client_app:app"

[tool.flwr.app.config]
num-server-rounds = 2
fraction-train = 0.5
local-epochs = 1
lr = 0.1
batch-size = 32
run-label = "quickstart"

[tool.flwr.federations]
default = "local-simulation"

[tool.flwr.federations.local-simulation]
options.num-supernodes = 4
"""

TASK = '''\
"""The model and the data: a small MLP on scikit-learn's digits, one IID shard per partition."""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

_DATA = None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    global _DATA
    if _DATA is None:
        x, y = load_digits(return_X_y=True)
        order = np.random.default_rng(42).permutation(len(y))
        _DATA = (torch.tensor(x[order] / 16.0, dtype=torch.float32), torch.tensor(y[order]))
    x, y = _DATA
    shard = np.array_split(np.arange(len(y)), num_partitions)[partition_id]
    cut = int(0.8 * len(shard))
    train, test = shard[:cut], shard[cut:]
    return (DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True),
            DataLoader(TensorDataset(x[test], y[test]), batch_size=batch_size))


def train(net, loader, epochs: int, lr: float) -> float:
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    total, seen = 0.0, 0
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            total, seen = total + loss.item() * len(yb), seen + len(yb)
    return total / seen


def test(net, loader):
    net.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for xb, yb in loader:
            out = net(xb)
            loss += nn.functional.cross_entropy(out, yb, reduction="sum").item()
            correct += (out.argmax(1) == yb).sum().item()
            n += len(yb)
    return loss / n, correct / n
'''

SERVER = '''\
"""The ServerApp: Flower's FedAvg (message API) from a fresh model."""

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from {pkg}.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    num_rounds = context.run_config["num-server-rounds"]
    strategy = FedAvg(fraction_train=context.run_config["fraction-train"], fraction_evaluate=1.0)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                   train_config=ConfigRecord({{"lr": context.run_config["lr"]}}), num_rounds=num_rounds)
'''

CLIENT = '''\
"""The ClientApp: local SGD on this node's shard, evaluation on its held-out part."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from {pkg}.task import Net, load_data
from {pkg}.task import test as test_fn
from {pkg}.task import train as train_fn

app = ClientApp()


def _setup(msg: Message, context: Context):
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loaders = load_data(context.node_config["partition-id"], context.node_config["num-partitions"],
                        context.run_config["batch-size"])
    return model, loaders


@app.train()
def train(msg: Message, context: Context) -> Message:
    model, (trainloader, _) = _setup(msg, context)
    loss = train_fn(model, trainloader, context.run_config["local-epochs"], msg.content["config"]["lr"])
    metrics = MetricRecord({{"train_loss": loss, "num-examples": len(trainloader.dataset)}})
    return Message(RecordDict({{"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model, (_, testloader) = _setup(msg, context)
    loss, acc = test_fn(model, testloader)
    metrics = MetricRecord({{"eval_loss": loss, "eval_acc": acc, "num-examples": len(testloader.dataset)}})
    return Message(RecordDict({{"metrics": metrics}}), reply_to=msg)
'''


def write_app(root: Path, pkg: str = "quickapp", files: dict[str, str] | None = None,
              pyproject: str | None = None) -> Path:
    """The quickstart app in ``root`` (package ``pkg``); ``files`` replace its modules' text."""
    (root / pkg).mkdir(parents=True)
    (root / "pyproject.toml").write_text(pyproject if pyproject is not None else
                                         PYPROJECT.format(name=pkg.replace("_", "-"), pkg=pkg))
    texts = {"__init__.py": "", "task.py": TASK, "server_app.py": SERVER.format(pkg=pkg),
             "client_app.py": CLIENT.format(pkg=pkg), **(files or {})}
    for name, text in texts.items():
        (root / pkg / name).write_text(textwrap.dedent(text))
    return root


@pytest.fixture(scope="module")
def app_dir(tmp_path_factory) -> Path:
    return write_app(tmp_path_factory.mktemp("flower-app"))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One MLflow store for the module's tracked runs (creating a store costs seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def metrics_of(summary) -> list[dict[str, float]]:
    """Per round, every metric except the wall-clock ones."""
    return [{k: v for k, v in r.as_metrics().items() if k != "round/seconds"} for r in summary.records]


def test_local_run_logs_per_round_metrics_to_mlflow(app_dir, store, capsys) -> None:
    tracking_uri = store
    assert main(["run-app", str(app_dir), "--seed", "3", "--tracking-uri", tracking_uri, "--quiet"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("run ") and len(out.splitlines()) == 1, out
    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(out.split()[1])
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == EXPERIMENT
    params = run.data.params
    assert params["engine"] == "local" and params["seed"] == "3"
    assert params["num_nodes"] == "4"  # the app's federation: options.num-supernodes
    assert params["run_config.num-server-rounds"] == "2" and params["run_config.lr"] == "0.1"
    for key in ("train/train_loss", "evaluate/eval_loss", "evaluate/eval_acc"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2], key
    counts = {k: [m.value for m in client.get_metric_history(run.info.run_id, k)]
              for k in ("round/train_ok", "round/train_failed", "round/evaluate_ok", "round/evaluate_failed")}
    assert counts == {"round/train_ok": [2, 2], "round/train_failed": [0, 0], "round/evaluate_ok": [4, 4],
                      "round/evaluate_failed": [0, 0]}  # fraction-train 0.5 of 4 nodes; evaluate on all
    assert "num-examples" not in " ".join(run.data.metrics)  # the weight, not a metric
    acc = [m.value for m in client.get_metric_history(run.info.run_id, "evaluate/eval_acc")]
    assert 0.0 < acc[0] <= 1.0 and acc[1] > acc[0]  # it learns
    assert run.data.tags["app"] == "quickapp"


def test_same_seed_same_metrics_and_overrides_apply(app_dir) -> None:
    """Seeding makes a run repeatable and the seed matters; a run-config override changes the run."""
    a = run_app(app_dir, seed=1, tracking=False)
    b = run_app(app_dir, seed=1, tracking=False)
    c = run_app(app_dir, seed=2, tracking=False)
    assert [r.round for r in a.records] == [1, 2]
    assert metrics_of(a) == metrics_of(b)
    assert metrics_of(a) != metrics_of(c)
    one = run_app(app_dir, ["num-server-rounds=1 fraction-train=1.0"], seed=1, num_nodes=3, tracking=False)
    assert [r.round for r in one.records] == [1]
    assert one.records[0].metrics["round/train_ok"] == 3  # --num-nodes wins over the app's 4; all of them train
    assert one.plan.run_config["fraction-train"] == 1.0 and one.plan.run_config["num-server-rounds"] == 1


FLAKY_CLIENT = CLIENT.replace(
    "    model, (trainloader, _) = _setup(msg, context)\n",
    "    if context.node_config['partition-id'] == 1:\n        raise RuntimeError('flaky node')\n"
    "    model, (trainloader, _) = _setup(msg, context)\n")
CRASH_SERVER = SERVER + "    raise ZeroDivisionError('after the rounds')\n"


def test_client_failures_are_counted_and_a_crash_ends_the_run_failed(tmp_path, store, capsys) -> None:
    flaky = write_app(tmp_path / "flaky", "flaky_app", {"client_app.py": FLAKY_CLIENT.format(pkg="flaky_app")})
    summary = run_app(flaky, ["fraction-train=1.0", "num-server-rounds=1"], tracking=False)
    (record,) = summary.records
    assert record.metrics["round/train_ok"] == 3 and record.metrics["round/train_failed"] == 1
    assert record.metrics["round/evaluate_ok"] == 4 and record.clients_failed == 1
    assert "partition 1" in record.failures[0] and "flaky node" in record.failures[0]

    crash = write_app(tmp_path / "crash", "crash_app", {"server_app.py": CRASH_SERVER.format(pkg="crash_app")})
    assert main(["run-app", str(crash), "num-server-rounds=1", "--tracking-uri", store, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "ServerApp raised ZeroDivisionError: after the rounds" in err, err
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id],
                                "tags.app = 'crash-app'")
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "evaluate/eval_acc")] == [1]  # round 1 kept


def test_too_few_nodes_for_the_strategy_fails_instead_of_waiting(app_dir) -> None:
    """FedAvg waits (polling once a second) for min_available_nodes=2; one simulated node never becomes two."""
    with pytest.raises(RunFailedError, match="waiting for more nodes than the 1 simulated"):
        run_app(app_dir, num_nodes=1, tracking=False)


def test_run_config_typing() -> None:
    defaults = {"rounds": 3, "lr": 0.1, "on": False, "name": "x"}
    assert merge_run_config(defaults, ["rounds=5 lr=1", "on=true", 'name="a b"']) == \
        {"rounds": 5, "lr": 1.0, "on": True, "name": "a b"}
    assert merge_run_config(defaults, ["name=7"])["name"] == "7"  # a string key keeps the text


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ray", "flower"])
def test_other_engines_give_the_local_metrics(app_dir, engine) -> None:
    local = run_app(app_dir, seed=5, tracking=False)
    other = run_app(app_dir, seed=5, engine=engine, tracking=False)
    assert metrics_of(other) == metrics_of(local)


LEGACY_SERVER = '''\
"""The ServerApp of Flower's older templates: ``server_fn`` and a ``flwr.server.strategy`` FedAvg."""

from flwr.common import ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg

from {pkg}.task import Net


def weighted_accuracy(metrics):
    n = sum(k for k, _ in metrics)
    return {{"accuracy": sum(k * m["accuracy"] for k, m in metrics) / n}}


def server_fn(context):
    initial = ndarrays_to_parameters([v.detach().numpy() for v in Net().state_dict().values()])
    strategy = FedAvg(fraction_fit=context.run_config["fraction-train"], fraction_evaluate=1.0,
                      min_available_clients=2, initial_parameters=initial,
                      evaluate_metrics_aggregation_fn=weighted_accuracy)
    return ServerAppComponents(strategy=strategy,
                               config=ServerConfig(num_rounds=context.run_config["num-server-rounds"]))


app = ServerApp(server_fn=server_fn)
'''

LEGACY_CLIENT = '''\
"""The ClientApp of Flower's older templates: ``client_fn`` returning a ``NumPyClient``."""

import torch
from flwr.client import ClientApp, NumPyClient

from {pkg}.task import Net, load_data, test, train


class FlowerClient(NumPyClient):
    def __init__(self, trainloader, testloader, epochs, lr):
        self.net, self.trainloader, self.testloader = Net(), trainloader, testloader
        self.epochs, self.lr = epochs, lr

    def _set(self, parameters):
        self.net.load_state_dict({{k: torch.tensor(w) for k, w in zip(self.net.state_dict(), parameters)}})

    def fit(self, parameters, config):
        self._set(parameters)
        loss = train(self.net, self.trainloader, self.epochs, self.lr)
        weights = [v.detach().numpy() for v in self.net.state_dict().values()]
        return weights, len(self.trainloader.dataset), {{"train_loss": loss}}

    def evaluate(self, parameters, config):
        self._set(parameters)
        loss, acc = test(self.net, self.testloader)
        return loss, len(self.testloader.dataset), {{"accuracy": acc}}


def client_fn(context):
    trainloader, testloader = load_data(context.node_config["partition-id"], context.node_config["num-partitions"],
                                        context.run_config["batch-size"])
    return FlowerClient(trainloader, testloader, context.run_config["local-epochs"], context.run_config["lr"]).to_client()


app = ClientApp(client_fn=client_fn)
'''


@pytest.fixture(scope="module")
def legacy_app(tmp_path_factory) -> Path:
    """The quickstart as Flower's older templates write it: ``server_fn`` / ``client_fn``, a NumPyClient."""
    return write_app(tmp_path_factory.mktemp("legacy-app"), "legacy_app",
                     {"server_app.py": LEGACY_SERVER.format(pkg="legacy_app"),
                      "client_app.py": LEGACY_CLIENT.format(pkg="legacy_app")})


def close_metrics(a, b) -> bool:
    """Equal keys and values up to float rounding: Flower's legacy server aggregates the replies in
    the order of a set of futures, which varies from run to run."""
    return [r.keys() for r in a] == [r.keys() for r in b] and all(
        v == pytest.approx(r2[k], rel=1e-6, abs=1e-9) for r, r2 in zip(a, b) for k, v in r.items())


def test_legacy_server_fn_and_client_fn_app(legacy_app) -> None:
    """A ``ServerApp(server_fn=...)`` / ``ClientApp(client_fn=...)`` app: its per-round metrics come out
    of Flower's compat records (``fitres.metrics``, ``evaluateres.loss``, weights ``num_examples``), the
    rounds are the strategy's, the seed repeats it and matters, and too few nodes is an error, not a
    day-long ``ClientManager.wait_for``."""
    a = run_app(legacy_app, seed=1, tracking=False)
    assert [r.round for r in a.records] == [1, 2]
    first, last = metrics_of(a)[0], metrics_of(a)[-1]
    assert {"train/train_loss", "evaluate/loss", "evaluate/accuracy"} <= first.keys()
    assert not any("num_examples" in k or "num-examples" in k for k in first)
    assert first["round/train_ok"] == 2 and first["round/evaluate_ok"] == 4
    assert last["evaluate/loss"] < first["evaluate/loss"]  # it learns
    assert close_metrics(metrics_of(run_app(legacy_app, seed=1, tracking=False)), metrics_of(a))
    assert not close_metrics(metrics_of(run_app(legacy_app, seed=2, tracking=False)), metrics_of(a))
    with pytest.raises(RunFailedError, match="min_available_clients=2 but only 1 nodes"):
        run_app(legacy_app, num_nodes=1, tracking=False)


def test_the_app_sees_node_ids_partition_plus_one_whatever_the_engine_gives() -> None:
    """Flower's simulation gives random node ids: the ServerApp sees ``partition + 1`` (so a legacy
    client manager, which samples by node id, picks the local engine's clients), its messages reach
    the engine's nodes and the replies come back from the ids it knows, in partition order."""
    from flwr.app import Message, Metadata, RecordDict

    from fedsim.run_app import AppGrid, RoundCollector

    engine_ids = {9001: 1, 42: 0, 777: 2}  # engine node id -> partition

    def message(dst: int, src: int = 0, reply_to: str = "") -> Message:
        meta = Metadata(run_id=1, message_id="", src_node_id=src, dst_node_id=dst, reply_to_message_id=reply_to,
                        group_id="1", created_at=0.0, ttl=60.0, message_type="query")
        return Message(metadata=meta, content=RecordDict())

    class Inner:
        sent: list[int] = []

        def get_node_ids(self):
            return list(engine_ids)

        def send_and_receive(self, messages, timeout=None):
            self.sent = [m.metadata.dst_node_id for m in messages]
            return [message(0, src=node) for node in reversed(self.sent)]

    inner = Inner()
    grid = AppGrid(inner, RoundCollector([]), engine_ids)
    assert grid.get_node_ids() == [1, 2, 3]
    replies = grid.send_and_receive([message(n) for n in (3, 1, 2)])
    assert inner.sent == [777, 42, 9001]
    assert [r.metadata.src_node_id for r in replies] == [1, 2, 3]


BAD_MODULE = "import nonexistent_pkg_xyz\n"


@pytest.mark.parametrize("case, expect", [
    ("missing", "no such directory"),
    ("no-pyproject", "no pyproject.toml"),
    ("no-flwr-section", "no [tool.flwr.app] section"),
    ("malformed-component", "expected \"module:attribute\""),
    ("import-error", "importing module 'badimp.server_app' raised ModuleNotFoundError"),
    ("syntax-error", "raised SyntaxError"),
    ("missing-module", "cannot import module 'nomod.server_app'"),
    ("no-attribute", "has no attribute 'nope'"),
    ("not-a-serverapp", "is a int, not a flwr ServerApp"),
    ("not-a-clientapp", "is a ServerApp, not a flwr ClientApp"),
    ("unknown-key", "unknown key 'rounds'"),
    ("bad-int", "num-server-rounds=two is not an integer"),
    ("bad-float", "fraction-train=abc is not a number"),
    ("bad-pair", "expected key=value pairs"),
    ("bad-engine", "runs on local, ray, flower"),
    ("bad-toml", "not valid TOML"),
])
def test_bad_input_is_one_line_and_exit_2(case, expect, tmp_path, in_tmp, capsys) -> None:
    root = tmp_path / "app"
    pkg = case.replace("-", "_")
    args: list[str] = []
    if case == "missing":
        pass
    elif case == "no-pyproject":
        root.mkdir()
    elif case == "no-flwr-section":
        root.mkdir()
        (root / "pyproject.toml").write_text('[project]\nname = "x"\n')
    elif case == "bad-toml":
        root.mkdir()
        (root / "pyproject.toml").write_text("[tool.flwr.app\n")
    elif case == "malformed-component":
        write_app(root, pkg, pyproject=PYPROJECT.format(name="x", pkg=pkg).replace(
            f'"{pkg}.server_app:app"', f'"{pkg}/server_app.py"'))
    elif case == "import-error":
        write_app(root, "badimp", {"server_app.py": BAD_MODULE})
    elif case == "syntax-error":
        write_app(root, pkg, {"server_app.py": "def broken(:\n"})
    elif case == "missing-module":
        write_app(root, pkg, pyproject=PYPROJECT.format(name="x", pkg=pkg).replace(f'"{pkg}.server_app:app"',
                                                                                   '"nomod.server_app:app"'))
    elif case == "no-attribute":
        write_app(root, pkg, pyproject=PYPROJECT.format(name="x", pkg=pkg).replace("server_app:app", "server_app:nope"))
    elif case == "not-a-serverapp":
        write_app(root, pkg, {"server_app.py": "app = 3\n"})
    elif case == "not-a-clientapp":
        write_app(root, pkg, {"client_app.py": "from flwr.serverapp import ServerApp\napp = ServerApp()\n"})
    else:
        write_app(root, pkg)
        args = {"unknown-key": ["rounds=3"], "bad-int": ["num-server-rounds=two"],
                "bad-float": ["--run-config", "fraction-train=abc"], "bad-pair": ["--run-config", "justtext"],
                "bad-engine": ["--engine", "mypkg.engines:run"]}[case]
    assert main(["run-app", str(root), *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("fedsim: error: ") and expect in err, err
    assert not (in_tmp / "mlflow.db").exists()  # nothing recorded
