"""Hostile inputs keep the CLI contract: exit 2, ONE line ``fedsim: error: ...``, nothing recorded.

Every case runs in-process through :func:`fedsim.cli.main` from an empty working directory (the
default MLflow store, ``./mlflow.db``, and the default checkpoint directory land there), so after
it we can check that no MLflow run exists (no RUNNING one either), and that no checkpoint
directory was made.  A handful of process-level cases (``fedsim ui``: port and signals) run as
subprocesses.  A Hypothesis layer throws random overrides at :func:`fedsim.config.load_config`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsim import config as C
from fedsim.cli import main
from fedsim.errors import ConfigError

HEX = "0123456789abcdef" * 2  # a well-formed MLflow run id that names no run
FAST = ["--rounds", "1", "--clients", "2", "data.name=digits", "data.partition.name=iid", "model.name=mlp"]
LONG = "x" * 5000

#: Files the cases refer to as {name}; written into the test's working directory.
FILES: dict[str, bytes] = {
    "nonutf8.yaml": b"name: caf\xe9\nrounds: 1\n",
    "badyaml.yaml": b"rounds: 3\n  clients: 2\n",
    "tabs.yaml": b"rounds:\t\t- [\n",
    "list.yaml": b"- 1\n- 2\n",
    "scalar.yaml": b"42\n",
    "nope.yaml": b"client:\n  lr: ${nope}\n",
    "env.yaml": b"description: ${oc.env:HOME}\n",
    "envdeep.yaml": b"client:\n  params:\n    token: x${oc.env:HOME}y\n",
    "resolver.yaml": b"client:\n  lr: ${oc.decode:'0.1'}\n",
    "unknownkey.yaml": b"clientz: {lr: 1}\n",
    "wrongtype.yaml": b"rounds: many\n",
    "target.yaml": b"_target_: os.system\n",
    "pytag.yaml": b"rounds: !!python/object/apply:os.system ['true']\n",
    "inf.yaml": b"client: {lr: .inf}\n",
    "negmom.yaml": b"client: {momentum: -1}\n",
    "bigrounds.yaml": b"rounds: 100000000000000000000\n",
    "sweep_badgrid.yaml": b"experiment: fedavg_digits\ngrid: {client.lr: 0.1}\n",
    "sweep_env.yaml": b"experiment: fedavg_digits\ndescription: ${oc.env:HOME}\ngrid: {client.lr: [0.1]}\n",
    "sweep_unknown.yaml": b"experiment: nope_nope\ngrid: {client.lr: [0.1]}\n",
    "sweep_badlr.yaml": b"experiment: fedavg_digits\ngrid: {client.lr: [.nan]}\n",
    "sweep_cpus.yaml": b"experiment: fedavg_digits\ncpus_per_trial: .nan\ngrid: {client.lr: [0.1]}\n",
    "sweep_gpus.yaml": b"experiment: fedavg_digits\ngpus_per_trial: -0.5\ngrid: {client.lr: [0.1]}\n",
    "claim_env.yaml": b"experiment: fedavg_digits\noverrides: ['client.lr=${oc.env:HOME}']\ngrid: {rounds: [1]}\n",
    "claim_empty.yaml": b"experiment: fedavg_digits\ngrid: {}\n",
    "claim_seeds.yaml": b"experiment: fedavg_digits\nseeds: abc\ngrid: {rounds: [1]}\n",
    "claim_eps.yaml": b"experiment: fedavg_digits\ngrid: {eps: [1e300]}\nseeds: [0]\n",
    "claim_badkey.yaml": b"experiment: fedavg_digits\ngrid: {client.lrr: [0.1]}\nseeds: [0]\n",
    "afile": b"not a directory\n",
}

#: (argv, a phrase the one-line error must contain).  {tmp} is the working directory.
CASES: list[tuple[list[str], str]] = [
    # --- run: the cases of issue #28 -----------------------------------------------------------
    (["run", "fedavg", "client.lr=inf"], "client.lr must be in (0, inf)"),
    (["run", "fedavg", "client.lr=nan"], "client.lr"),
    (["run", "fedavg", "client.lr=-inf"], "client.lr"),
    (["run", "fedavg", "--eps", "1e300"], "privacy.epsilon must be in (0, 1000]"),
    (["run", "fedavg", "--eps", "inf"], "privacy.epsilon"),
    (["run", "fedavg", "--eps", "3", "privacy.noise_multiplier=1"], "set either --eps or privacy.noise_multiplier"),
    (["run", "fedavg", "--rounds", "1e20"], "expected an integer"),
    (["run", "fedavg", "--rounds", "100000000000000000000"], "rounds must be in [1, 100000]"),
    (["run", "fedavg", "rounds=1e20"], "rounds"),
    (["run", "fedavg", "rounds=100001"], "rounds must be in [1, 100000]"),
    (["run", "fedavg", "client.lr=${nope}"], "client.lr"),
    (["run", "{tmp}/nope.yaml"], "Interpolation key 'nope' not found"),
    (["run", "{tmp}/nonutf8.yaml"], "not UTF-8"),
    (["run", "fedavg", "client.momentum=-1"], "client.momentum must be in [0, 1]"),
    (["run", "fedavg", "client.weight_decay=-1"], "client.weight_decay must be in [0, inf)"),
    (["run", "fedavg", "evaluation.batch_size=0"], "evaluation.batch_size must be in [1, 1000000]"),
    (["run", "fedavg", "data.client_test_fraction=0", "strategy.fraction_evaluate=0.5"], "data.client_test_fraction=0"),
    (["run", "fedavg", f"name={LONG}"], "name is 5000 characters long"),
    (["run", "fedavg", f"tracking.experiment={LONG}"], "tracking.experiment is 5000 characters long"),
    (["run", "fedavg", "engine.checkpoint_dir={tmp}/afile/ckpt"], "engine.checkpoint_dir"),
    (["run", "fedavg", "engine.checkpoint_dir=/proc/self/fedsim-ckpt"], "is not writable"),  # even for root
    (["run", "fedavg", "engine.round_timeout_s=inf"], "engine.round_timeout_s must be in (0, 1e6]"),
    (["run", "fedavg", "engine.faults.hang_s=inf"], "engine.faults.hang_s"),
    # --- run: secrets by interpolation ---------------------------------------------------------
    (["run", "fedavg", "client.lr=${oc.env:HOME}"], "uses a resolver"),
    (["run", "fedavg", "description=${oc.env:HOME}"], "uses a resolver"),
    (["run", "fedavg", "client.params.token=${oc.env:PATH}"], "uses a resolver"),
    (["run", "fedavg", "description=a${env:HOME}b"], "uses a resolver"),
    (["run", "{tmp}/env.yaml"], "uses a resolver"),
    (["run", "{tmp}/envdeep.yaml"], "client.params.token"),
    (["run", "{tmp}/resolver.yaml"], "uses a resolver"),
    # --- run: bad numbers, wrong types, NaN/inf, negative sizes --------------------------------
    (["run", "fedavg", "client.batch_size=-5"], "client.batch_size"),
    (["run", "fedavg", "client.batch_size=1.5"], "client.batch_size"),
    (["run", "fedavg", "client.batch_size=abc"], "client.batch_size"),
    (["run", "fedavg", "client.local_epochs=0"], "client.local_epochs"),
    (["run", "fedavg", "client.local_steps=0"], "client.local_steps"),
    (["run", "fedavg", "num_clients=0"], "num_clients"),
    (["run", "fedavg", "--clients", "-3"], "num_clients"),
    (["run", "fedavg", "--seed", "-1"], "seed must be in [0, 4294967295]"),
    (["run", "fedavg", "seed=99999999999"], "seed"),
    (["run", "fedavg", "engine.round_timeout_s=0"], "engine.round_timeout_s"),
    (["run", "fedavg", "engine.round_timeout_s=1e300"], "engine.round_timeout_s"),
    (["run", "fedavg", "engine.client_timeout_s=-1"], "engine.client_timeout_s"),
    (["run", "fedavg", "engine.retries=-1"], "engine.retries"),
    (["run", "fedavg", "engine.retries=1000"], "engine.retries"),
    (["run", "fedavg", "engine.threads_per_client=0"], "engine.threads_per_client"),
    (["run", "fedavg", "engine.vectorise=maybe"], "engine.vectorise"),
    (["run", "fedavg", "engine.vectorise_chunk=0"], "engine.vectorise_chunk"),
    (["run", "fedavg", "engine.system.dropout=1"], "engine.system.dropout"),
    (["run", "fedavg", "engine.system.deadline_s=-1"], "engine.system.deadline_s"),
    (["run", "fedavg", "engine.system.seconds_per_step=nan"], "engine.system.seconds_per_step"),
    (["run", "fedavg", "engine.faults.raise_fraction=0.7", "engine.faults.hang_fraction=0.6"], "sum to at most 1"),
    (["run", "fedavg", "engine.faults.raise_fraction=-0.1"], "engine.faults.raise_fraction"),
    (["run", "fedavg", "engine.ray.actor_num_cpus=0"], "engine.ray.actor_num_cpus"),
    (["run", "fedavg", "engine.ray.num_actors=0"], "engine.ray.num_actors"),
    (["run", "fedavg", "engine.ray.client_resources.3.num_cpus=0"], "engine.ray.client_resources.3.num_cpus"),
    (["run", "fedavg", "engine.ray.client_resources.x.num_cpus=1"], "partition ids"),
    (["run", "fedavg", "engine.flower.client_num_cpus=-1"], "engine.flower.client_num_cpus"),
    (["run", "fedavg", "engine.flower.timeout_s=inf"], "engine.flower.timeout_s"),
    (["run", "fedavg", "strategy.fraction_train=0"], "strategy.fraction_train"),
    (["run", "fedavg", "strategy.fraction_train=1.5"], "strategy.fraction_train"),
    (["run", "fedavg", "strategy.fraction_evaluate=-1"], "strategy.fraction_evaluate"),
    (["run", "fedavg", "strategy.min_train_results=0"], "strategy.min_train_results"),
    (["run", "fedavg", "data.test_fraction=1"], "data.test_fraction"),
    (["run", "fedavg", "data.test_fraction=0"], "data.test_fraction"),
    (["run", "fedavg", "data.partition.alpha=0"], "data.partition.alpha"),
    (["run", "fedavg", "data.partition.min_partition_size=-1"], "data.partition.min_partition_size"),
    (["run", "fedavg", "evaluation.validation_fraction=1.5"], "evaluation.validation_fraction"),
    (["run", "fedavg", "tracking.experiment='  '"], "tracking.experiment must not be empty"),
    (["run", "fedavg", "privacy.enabled=true"], "set exactly one of"),
    (["run", "fedavg", "privacy.enabled=true", "privacy.noise_multiplier=-1"], "privacy.noise_multiplier"),
    (["run", "fedavg", "--eps", "3", "privacy.accountant=gdp"], "privacy.accountant"),
    (["run", "fedavg", "--eps", "3", "privacy.level=node"], "privacy.level"),
    (["run", "fedavg", "--eps", "3", "privacy.delta=0"], "privacy.delta"),
    (["run", "fedavg", "--eps", "3", "privacy.max_grad_norm=inf"], "privacy.max_grad_norm"),
    (["run", "fedavg", "--eps", "3", "privacy.max_physical_batch_size=0"], "privacy.max_physical_batch_size"),
    (["run", "fedavg", "--eps", "abc"], "invalid float value"),
    # --- run: unknown keys and names, malformed overrides ---------------------------------------
    (["run", "fedavg", "client.lrr=1"], "client.lrr"),
    (["run", "fedavg", "clientlr"], "bad override"),
    (["run", "fedavg", "=5"], "bad override"),
    (["run", "fedavg", "client=5"], "is a section"),
    (["run", "fedavg", "client.lr="], "client.lr"),
    (["run", "fedavg", "rounds=[1,2]"], "rounds"),
    (["run", "fedavg", "rounds={a: 1}"], "rounds"),
    (["run", "fedavg", "strategy.name=nope"], "nope"),
    (["run", "fedavg", "client.learner=nope"], "nope"),
    (["run", "fedavg", "data.name=nope"], "nope"),
    (["run", "fedavg", "model.name=resnet"], "unknown model 'resnet'"),
    (["run", "fedavg", "data.partition.name=zipf"], "unknown partitioner 'zipf'"),
    (["run", "fedavg", "client.optimizer=rmsprop"], "client.optimizer"),
    (["run", "fedavg", "--engine", "gpu"], "invalid choice"),
    (["run", "fedavg", "--rounds", "x"], "expected an integer"),
    (["run", "fedavg", "--rounds", ""], "expected an integer"),
    (["run", "fedavg", "--frobnicate"], "unrecognized arguments"),
    (["run"], "the following arguments are required"),
    (["run", "fedavg", "--tracking-uri"], "expected one argument"),
    # --- run: bad files ------------------------------------------------------------------------
    (["run", "nope"], "unknown experiment 'nope'"),
    (["run", "{tmp}/missing.yaml"], "experiment file not found"),
    (["run", "{tmp}/dir.yaml"], "experiment file not found"),
    (["run", "{tmp}"], "unknown experiment"),
    (["run", "{tmp}/badyaml.yaml"], "bad YAML at line 2"),
    (["run", "{tmp}/tabs.yaml"], "bad YAML"),
    (["run", "{tmp}/list.yaml"], "must be a mapping"),
    (["run", "{tmp}/scalar.yaml"], "must be a mapping"),
    (["run", "{tmp}/unknownkey.yaml"], "clientz"),
    (["run", "{tmp}/wrongtype.yaml"], "rounds"),
    (["run", "{tmp}/target.yaml"], "_target_"),
    (["run", "{tmp}/pytag.yaml"], "bad YAML"),
    (["run", "{tmp}/inf.yaml"], "client.lr"),
    (["run", "{tmp}/negmom.yaml"], "client.momentum"),
    (["run", "{tmp}/bigrounds.yaml"], "rounds"),
    (["run", "clic", "--rounds", "3"], "applies to federated experiments"),
    (["run", "clic", "seed=-1"], "seed"),
    (["run", "clic", "params.token=${oc.env:HOME}"], "uses a resolver"),
    # --- run --resume --------------------------------------------------------------------------
    (["run", "fedavg", "--resume", "abc"], "is not an MLflow run id"),
    (["run", "fedavg", "--resume", HEX.upper()], "is not an MLflow run id"),
    (["run", "fedavg", "--resume", HEX + "0"], "is not an MLflow run id"),
    (["run", "fedavg", "--resume", "../" + HEX[:29]], "is not an MLflow run id"),
    (["run", "fedavg", "--resume", ""], "is not an MLflow run id"),
    (["run", "fedavg", *FAST, "--resume", HEX, "--no-tracking"], "needs tracking"),
    (["run", "fedavg", *FAST, "--resume", HEX, "--engine", "flower"], "--resume works on the"),
    # --- sweep ---------------------------------------------------------------------------------
    (["sweep", "fedavg_digits", "--grid", "client.lr=[0.1"], "no brackets"),
    (["sweep", "fedavg_digits", "--grid", "client.lr=[0.1,0.2]"], "no brackets"),
    (["sweep", "fedavg_digits", "--grid", "client.lr={a: 1}"], "not a plain value"),
    (["sweep", "fedavg_digits", "--grid", "client.lr="], "KEY=V1,V2"),
    (["sweep", "fedavg_digits", "--grid", "=1,2"], "KEY=V1,V2"),
    (["sweep", "fedavg_digits", "--grid", "client.lr=0.1,,0.2"], "not a plain value"),
    (["sweep", "fedavg_digits", "--grid", "client.lr=${oc.env:HOME}"], "uses a resolver"),
    (["sweep", "fedavg_digits", "--grid", "client.lr=inf"], "client.lr"),
    (["sweep", "fedavg_digits", "--grid", "client.lrr=0.1"], "client.lrr"),
    (["sweep", "fedavg_digits", "--grid", "eps=1e300"], "privacy.epsilon"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--cpus-per-trial", "99"], "exceeds the"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--cpus-per-trial", "0"], "cpus_per_trial must be > 0"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--cpus-per-trial", "nan"], "expected a finite number"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--cpus-per-trial", "inf"], "expected a finite number"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--cpus-per-trial", "-1"], "cpus_per_trial must be > 0"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--gpus-per-trial", "-1"], "gpus_per_trial must be 0"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--gpus-per-trial", "9"], "a whole number up to 8"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--gpus-per-trial", "1.5"], "a whole number up to 8"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--gpus-per-trial", "nan"], "expected a finite number"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--gpus-per-trial", "inf"], "expected a finite number"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "engine.device=cuda"], "add --gpus-per-trial"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--seeds", "0"], "expected 1 to 10000 seeds"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--seeds", "1000000000"], "expected 1 to 10000 seeds"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--max-concurrent", "-1"], "max_concurrent"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--resume", "xyz"], "is not an MLflow run id"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "tracking.enabled=false"], "needs" if False else "child runs"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "engine.checkpoint_dir={tmp}/afile/c"], "engine.checkpoint_dir"),
    (["sweep", "fedavg_digits"], "give a grid"),
    (["sweep", "nope_nope", "--grid", "rounds=1"], "unknown experiment"),
    (["sweep", "{tmp}/sweep_badgrid.yaml"], "grid"),
    (["sweep", "{tmp}/sweep_env.yaml"], "uses a resolver"),
    (["sweep", "{tmp}/sweep_unknown.yaml"], "unknown experiment"),
    (["sweep", "{tmp}/sweep_badlr.yaml"], "client.lr"),
    (["sweep", "{tmp}/sweep_cpus.yaml"], "cpus_per_trial must be > 0"),
    (["sweep", "{tmp}/sweep_gpus.yaml"], "gpus_per_trial must be 0"),
    (["sweep", "{tmp}/nonutf8.yaml"], "not UTF-8"),
    # --- reproduce -----------------------------------------------------------------------------
    (["reproduce", "nope_nope"], "no claim check named"),
    (["reproduce", "{tmp}/missing.yaml"], "no claim check named"),
    (["reproduce", "{tmp}/claim_env.yaml"], "uses a resolver"),
    (["reproduce", "{tmp}/claim_empty.yaml"], "grid is empty"),
    (["reproduce", "{tmp}/claim_seeds.yaml"], "seeds"),
    (["reproduce", "{tmp}/claim_eps.yaml"], "privacy.epsilon"),
    (["reproduce", "{tmp}/claim_badkey.yaml"], "client.lrr"),
    (["reproduce", "{tmp}/nonutf8.yaml"], "not UTF-8"),
    (["reproduce", "{tmp}/badyaml.yaml"], "bad YAML"),
    (["reproduce", "fedavg_alpha", "--seeds", "0"], "expected 1 to 10000 seeds"),
    (["reproduce", "fedavg_alpha", "--seeds", "99999"], "expected 1 to 10000 seeds"),
    (["reproduce", "fedavg_alpha", "--resume", "not-a-run"], "is not an MLflow run id"),
    (["reproduce", "fedavg_alpha", "client.lr=${oc.env:HOME}"], "uses a resolver"),
    (["reproduce", "fedavg_alpha", "client.lr=inf"], "client.lr"),
    # --- compare -------------------------------------------------------------------------------
    (["compare"], "give either a parent run id or --experiment"),
    (["compare", HEX, "--experiment", "fedavg"], "give either a parent run id or --experiment"),
    (["compare", "abc"], "is not an MLflow run id"),
    (["compare", HEX], f"no MLflow run '{HEX}'"),
    (["compare", HEX, "--tracking-uri", "sqlite:///{tmp}/elsewhere/none.db"], "no MLflow store at"),
    (["compare", "--experiment", "it's"], "no finished runs of experiment"),
    (["compare", "--experiment", 'a"b\'c'], "no finished runs of experiment"),
    (["compare", "--experiment", "x' OR tags.experiment LIKE '%"], "no finished runs of experiment"),
    (["compare", "--experiment", LONG], "no finished runs of experiment"),
    (["compare", "--experiment", "fedavg", "--out", "{tmp}/afile/out"], "--out"),
    (["compare", "--experiment", "fedavg", "--out", "{tmp}/afile"], "--out"),
    (["compare", "--experiment", "fedavg", "--out", "/proc/self/fedsim-plots"], "is not writable"),
    # --- ui --------------------------------------------------------------------------------------
    (["ui", "--port", "99999"], "a TCP port is 1 to 65535"),
    (["ui", "--port", "-1"], "a TCP port is 1 to 65535"),
    (["ui", "--port", "0"], "a TCP port is 1 to 65535"),
    (["ui", "--port", "abc"], "expected an integer"),
    (["ui", "--port", "5000", "--frobnicate"], "unrecognized arguments"),
    # --- the top level -------------------------------------------------------------------------
    (["frobnicate"], "invalid choice"),
    ([], "the following arguments are required"),
]


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An initialised MLflow sqlite store with no runs (made once: migrations take seconds)."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def hostile_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory with the case files, its own TMPDIR and no tracking URI set."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "dir.yaml").mkdir()
    return tmp_path


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse errors
        return int(exc.code or 0)


def recorded_runs(cwd: Path) -> list[str]:
    """Statuses of every MLflow run in the working directory's default store (none if it is absent)."""
    db = cwd / "mlflow.db"
    if not db.exists():
        return []
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exps = [e.experiment_id for e in client.search_experiments()]
    return [r.info.status for r in client.search_runs(exps)] if exps else []


def assert_contract(code: int, err: str, cwd: Path, needle: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("fedsim: error: "), err
    assert "Traceback" not in err
    assert needle in lines[0], lines[0]
    assert recorded_runs(cwd) == []  # nothing recorded, so nothing left RUNNING
    assert not (cwd / "fedsim-checkpoints").exists()
    assert not (cwd / "fedsim-sweeps").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "needle"), CASES, ids=[" ".join(a)[:60] or "empty" for a, _ in CASES])
def test_hostile_input_one_line_exit_2_nothing_recorded(argv, needle, hostile_cwd, capsys, request) -> None:
    if argv[:1] == ["compare"]:  # compare reads a store: give it an empty one, so the query itself runs
        shutil.copy(request.getfixturevalue("empty_store"), hostile_cwd / "mlflow.db")
        capsys.readouterr()  # the store fixture's own MLflow logs
    argv = [a.replace("{tmp}", str(hostile_cwd)) for a in argv]
    code = run_cli(argv)
    assert_contract(code, capsys.readouterr().err, hostile_cwd, needle)


def test_the_suite_is_big_enough() -> None:
    """Issue #28: the issue's cases and at least 60 more."""
    assert len(CASES) >= 100
    assert len({tuple(a) for a, _ in CASES}) == len(CASES)  # no duplicates


def test_busy_port_for_ui_is_one_line(hostile_cwd, capsys) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = run_cli(["ui", "--port", str(port)])
    assert_contract(code, capsys.readouterr().err, hostile_cwd, f"port {port} on 127.0.0.1 is not available")


def test_compare_out_unwritable_directory(hostile_cwd, capsys) -> None:
    locked = hostile_cwd / "locked"
    locked.mkdir(mode=0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: directory modes are not enforced")
        code = run_cli(["compare", "--experiment", "fedavg", "--out", str(locked / "plots")])
    finally:
        locked.chmod(0o700)
    assert_contract(code, capsys.readouterr().err, hostile_cwd, "is not writable")


# --- process level: `fedsim ui` -------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_ui_bad_port_subprocess_exits_2_at_once(port, tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "fedsim", "ui", "--port", port], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("fedsim: error:")
    assert not (tmp_path / "mlflow.db").exists()


#: A stand-in server whose listening socket is shared with a worker child, as MLflow's workers do.
FAKE_SERVER = """
import socket, subprocess, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", {port})); s.listen()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(s.fileno(),))
time.sleep(600)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_ui_signal_stops_the_whole_server_group(sig, tmp_path) -> None:
    """What `fedsim ui` does with its server (cli._serve), with a fast stand-in for MLflow."""
    port = _free_port()
    driver = ("import os, sys; from fedsim.cli import _serve; "
              f"sys.exit(_serve([sys.executable, '-c', {FAKE_SERVER.format(port=port)!r}], dict(os.environ)))")
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.time() + 40
        while not _listening(port):
            assert proc.poll() is None and time.time() < deadline, "the stand-in server did not come up"
            time.sleep(0.2)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == (0 if sig == signal.SIGINT else 128 + sig)
        time.sleep(0.5)
        assert not _listening(port), "a worker of the server kept listening"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_ui_signal_stops_the_mlflow_server(sig, tmp_path) -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fedsim", "ui", "--port", str(port)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 150
        while not _listening(port):
            assert proc.poll() is None, "fedsim ui exited before serving"
            assert time.time() < deadline, "the MLflow server did not come up"
            time.sleep(0.5)
        proc.send_signal(sig)  # to fedsim only, as a service manager's SIGTERM or `kill -INT` would
        proc.wait(timeout=60)
        deadline = time.time() + 20
        while _listening(port) and time.time() < deadline:
            time.sleep(0.5)
        assert not _listening(port), "the MLflow server kept listening after fedsim ui ended"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --- property-based: random overrides of the typed config ----------------------------------------

def _leaves(cls: type, prefix: str = "") -> list[tuple[str, typing.Any]]:
    """(dotted key, type hint) of every scalar field of the config dataclasses."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, typing.Any]] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += _leaves(hint, f"{prefix}{f.name}.")
        elif typing.get_origin(hint) not in (dict, list):
            out.append((f"{prefix}{f.name}", hint))
    return out


LEAVES = _leaves(C.ExperimentConfig)
HOSTILE_TEXT = ["inf", "-inf", "nan", ".nan", "1e309", "-0", "0", "1e20", "-1", "true", "null", "~", "", " ",
                "[1", "{a: 1", "[1, 2]", "{a: 1}", "${nope}", "${oc.env:HOME}", "${rounds}", "${client.lr}",
                "\\${x}", "'", '"', "=", "a=b", "1_000", "0x10", "１", "\u00e9", "x" * 300]
VALUES = st.one_of(
    st.sampled_from(HOSTILE_TEXT),
    st.integers(min_value=-(10 ** 30), max_value=10 ** 30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),
)
OVERRIDES = st.lists(st.tuples(st.sampled_from([k for k, _ in LEAVES]), VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"),
                     min_size=1, max_size=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overrides=OVERRIDES)
def test_random_overrides_load_or_fail_with_one_line(overrides) -> None:
    """``load_config`` returns a valid config or raises a one-line ConfigError, never anything else."""
    try:
        cfg = C.load_config("fedavg", overrides)
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message and "\r" not in message
        return
    C.validate(cfg)  # what was accepted passes the same validation again
    C.check_fields(cfg)


def test_every_numeric_field_declares_its_range() -> None:
    """A new numeric field must declare its range (``rng``), so the one validation pass covers it."""
    undeclared = []

    def walk(cls: type, prefix: str = "") -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{f.name}.")
            elif hint in (int, float, typing.Optional[int], typing.Optional[float]) and "range" not in f.metadata:
                undeclared.append(f"{prefix}{f.name}")

    walk(C.ExperimentConfig)
    walk(C.ResourceHint, "engine.ray.client_resources.*.")
    assert undeclared in ([], ["engine.client_timeout_s"])  # client_timeout_s keeps a hand-written check
