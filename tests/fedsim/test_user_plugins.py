"""Issue #27: user code outside the package, by import path (``strategy.name=mypkg.mod:build``) or as a
plugin module (``--plugin mypkg.plugins`` / ``plugins:``), on every engine, with one-line errors.

The user package is the one of docs/adding-a-strategy.md#your-own-code (its ```py blocks), plus a tiny
model, written into a temporary directory that is on PYTHONPATH only: the package is never installed.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mlflow import MlflowClient

from fedsim import registry
from fedsim.cli import main

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "adding-a-strategy.md"
SMALL = ["--rounds", "2", "--clients", "2", "data.partition.name=iid", "strategy.fraction_evaluate=0"]

#: A user's own experiment file: their model (by import path) and strategy, their plugin module.
EXPERIMENT = """\
name: mine
rounds: 2
num_clients: 2
data: {name: digits, partition: {name: iid}}
model: {name: mypkg.models:tiny, params: {bias: false}}
strategy: {name: mypkg.strategies:build, params: {server_lr: 0}, fraction_evaluate: 0}
plugins: [mypkg.model_plugin]
"""

MODEL = '''\
# mypkg/models.py
from dataclasses import dataclass
from math import prod

from torch import nn


@dataclass
class TinyParams:
    bias: bool = True


def tiny(params: TinyParams, input_shape, num_classes):
    """One linear layer on the flattened input."""
    return nn.Sequential(nn.Flatten(), nn.Linear(prod(input_shape), num_classes, bias=params.bias))
'''

REGISTER_MODEL = '''\
# mypkg/model_plugin.py
from fedsim.registry import MODELS
from mypkg.models import TinyParams, tiny

MODELS.register("user_tiny", params=TinyParams)(tiny)
'''

BAD = {
    "mypkg/bad.py": "CONSTANT = 3\n\ndef one_arg(ctx):\n    return None\n",
    "mypkg/boom.py": "x = 1\nraise RuntimeError('boom at import')\n",
    "mypkg/syntax.py": "def build(ctx, params)\n    return 1\n",
    "mypkg/needs_dep.py": "import not_a_real_dependency_xyz\n\ndef build(ctx, params):\n    return None\n",
}


def _section() -> str:
    text = GUIDE.read_text()
    return text[text.index("## Your own code"):]


def guide_files() -> dict[str, str]:
    """``path -> source`` of the ```py blocks of the guide's "Your own code" section."""
    blocks = re.findall(r"^```py\n(.*?)^```", _section(), re.S | re.M)
    assert len(blocks) == 2, blocks
    return {block.splitlines()[0].removeprefix("# ").strip(): block for block in blocks}


def guide_commands() -> list[list[str]]:
    """The ``fedsim ...`` commands of the section, as argv without ``fedsim``."""
    blocks = re.findall(r"^```bash\n(.*?)^```", _section(), re.S | re.M)
    return [shlex.split(line)[1:] for block in blocks for line in block.splitlines() if line.startswith("fedsim ")]


def write_package(root: Path) -> Path:
    files = {**guide_files(), "mypkg/models.py": MODEL, "mypkg/model_plugin.py": REGISTER_MODEL, **BAD}
    (root / "mypkg").mkdir(parents=True, exist_ok=True)
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mine.yaml").write_text(EXPERIMENT)
    for path, source in files.items():
        (root / path).write_text(source)
    return root


@pytest.fixture
def userpkg(tmp_path, monkeypatch):
    """``mypkg`` in ``tmp_path/code``, importable in this process and in subprocesses (PYTHONPATH);
    its modules and registrations are forgotten afterwards."""
    code = write_package(tmp_path / "code")
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(code), *filter(None, [os.environ.get("PYTHONPATH")])]))
    yield code
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        del sys.modules[name]
    for r in registry.REGISTRIES:
        for name in [n for n, e in r._entries.items() if ":" in n or e.module.startswith("mypkg")]:
            del r._entries[name]
    registry._PLUGINS.difference_update({m for m in registry._PLUGINS if m.startswith("mypkg")})


def fedsim_run(argv: list[str], tracking_uri: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = argv if argv[0] == "run" else ["run", *argv]
    return subprocess.run([sys.executable, "-m", "fedsim", *argv, "--quiet", "--tracking-uri", tracking_uri],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def fedsim_in_process(argv: list[str], tracking_uri: str, capsys) -> subprocess.CompletedProcess:
    """``fedsim run ARGV`` through :func:`fedsim.cli.main` in this process (the package is on
    ``sys.path`` by the fixture, as PYTHONPATH puts it there for a fresh process): saves a
    process start where the first run of a test already showed the fresh-process path."""
    capsys.readouterr()
    argv = argv if argv[0] == "run" else ["run", *argv]
    code = main([*argv, "--quiet", "--tracking-uri", tracking_uri])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


def run_of(proc: subprocess.CompletedProcess, tracking_uri: str):
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = re.search(r"^run ([0-9a-f]{32})$", proc.stdout, re.M)
    assert match, proc.stdout
    return MlflowClient(tracking_uri=tracking_uri).get_run(match.group(1))


def accuracies(run, tracking_uri: str) -> list[float]:
    history = MlflowClient(tracking_uri=tracking_uri).get_metric_history(run.info.run_id, "eval/accuracy")
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def small(argv: list[str]) -> list[str]:
    """A guide command made tiny (2 rounds, 2 IID clients), the server step 0: the model never moves."""
    return [*[a if not a.startswith("strategy.params.server_lr=") else "strategy.params.server_lr=0" for a in argv],
            *SMALL]


# -- end to end: the guide's commands, as a user runs them --------------------------------------------
def test_import_path_strategy_and_model_run(userpkg, tracking_uri, tmp_path, capsys, in_tmp) -> None:
    """``strategy.name=mypkg.strategies:build``: the typed params reach it (server_lr=0 freezes the global
    model, so the server accuracy never moves) and a user model by import path trains in the clients."""
    command = guide_commands()[0]
    assert "strategy.name=mypkg.strategies:build" in command
    run = run_of(fedsim_run(small(command), tracking_uri, tmp_path), tracking_uri)
    acc = accuracies(run, tracking_uri)
    assert len(acc) == 3 and len(set(acc)) == 1, acc  # rounds 0, 1, 2: the same model
    assert run.data.params["strategy.name"] == "mypkg.strategies:build"
    mine = run_of(fedsim_in_process([str(userpkg / "mine.yaml"), "strategy.params.server_lr=1"], tracking_uri, capsys),
                  tracking_uri)  # the user's experiment file: their model, by import path, learns
    acc = accuracies(mine, tracking_uri)
    assert acc[-1] > acc[0] and mine.data.params["model.name"] == "mypkg.models:tiny", acc


def test_plugin_registers_a_named_strategy(userpkg, tracking_uri, tmp_path, capsys, in_tmp) -> None:
    """``--plugin mypkg.plugins`` registers ``server_step``; with server_lr=1 it learns (plain FedAvg)."""
    command = guide_commands()[1]
    assert "--plugin" in command and "strategy.name=server_step" in command
    frozen = run_of(fedsim_run(small(command), tracking_uri, tmp_path), tracking_uri)
    assert len(set(accuracies(frozen, tracking_uri))) == 1
    assert frozen.data.params["plugins"] in ("['mypkg.plugins']", '["mypkg.plugins"]')
    moving = run_of(fedsim_in_process([*small(command), "strategy.params.server_lr=1"], tracking_uri, capsys),
                    tracking_uri)
    acc = accuracies(moving, tracking_uri)
    assert acc[-1] != acc[0], acc


@pytest.mark.slow
def test_ray_workers_import_plugins_and_import_paths(userpkg, tracking_uri, tmp_path) -> None:
    """On the ray engine the actors build the learner and model: the model named by the experiment's
    plugin (``user_tiny``) and a learner by import path resolve there, with the package on PYTHONPATH only."""
    proc = fedsim_run([str(userpkg / "mine.yaml"), "--engine", "ray", "model.name=user_tiny",
                       "client.learner=clients.supervised:SupervisedLearner", "engine.ray.num_actors=1",
                       "engine.ray.ray_num_cpus=1"], tracking_uri, tmp_path)
    run = run_of(proc, tracking_uri)
    assert len(set(accuracies(run, tracking_uri))) == 1  # server_lr: 0 in mine.yaml
    assert run.data.params["model.name"] == "user_tiny"


# -- errors: one line, exit 2, no traceback -------------------------------------------------------------
@pytest.mark.parametrize(("argv", "needle"), [
    (["strategy.name=nopkg_xyz.mod:build"],
     "strategy.name='nopkg_xyz.mod:build': cannot import module 'nopkg_xyz.mod' (No module named 'nopkg_xyz'); "
     "check the path and that the package is installed or on PYTHONPATH"),
    (["strategy.name=mypkg.nothere:build"], "cannot import module 'mypkg.nothere' (No module named 'mypkg.nothere')"),
    (["strategy.name=mypkg.strategies:biuld"],
     "strategy.name='mypkg.strategies:biuld': module 'mypkg.strategies' has no attribute 'biuld'; it defines: "),
    (["strategy.name=mypkg.bad:CONSTANT"],
     "strategy.name='mypkg.bad:CONSTANT': 'CONSTANT' is a int, not callable; a strategy is CONSTANT(ctx, params)"),
    (["strategy.name=mypkg.bad:one_arg"],
     "strategy.name='mypkg.bad:one_arg': one_arg(ctx) has the wrong signature; a strategy is "
     "one_arg(ctx, params) -> a Flower Strategy"),
    (["model.name=mypkg.bad:one_arg"],
     "model.name='mypkg.bad:one_arg': one_arg(ctx) has the wrong signature; a model is "
     "one_arg(params, input_shape, num_classes) -> a torch nn.Module"),
    (["client.learner=mypkg.bad:one_arg"], "client.learner='mypkg.bad:one_arg': one_arg(ctx) has the wrong signature"),
    (["data.name=mypkg.bad:one_arg"], "data.name='mypkg.bad:one_arg': one_arg(ctx) has the wrong signature; "
                                      "a dataset is one_arg(params, seed)"),
    (["data.partition.name=mypkg.bad:CONSTANT"], "data.partition.name='mypkg.bad:CONSTANT': 'CONSTANT' is a int"),
    (["engine.name=mypkg.bad:CONSTANT"], "engine.name='mypkg.bad:CONSTANT': 'CONSTANT' is a int, not callable"),
    (["strategy.name=mypkg.boom:build"],
     "strategy.name='mypkg.boom:build': importing module 'mypkg.boom' raised RuntimeError: boom at import (at "),
    (["strategy.name=mypkg.syntax:build"],
     "strategy.name='mypkg.syntax:build': importing module 'mypkg.syntax' raised SyntaxError: "),
    (["strategy.name=mypkg.needs_dep:build"],
     "importing module 'mypkg.needs_dep' raised ModuleNotFoundError: No module named 'not_a_real_dependency_xyz'"),
    (["strategy.params.server_lr=0.5", "strategy.name=mypkg.strategies:build", "strategy.params.lr=1"],
     "strategy.params.lr: Key 'lr' not in 'Params'"),
    (["--plugin", "nopkg_xyz.plugins"], "--plugin: 'nopkg_xyz.plugins': cannot import module 'nopkg_xyz.plugins'"),
    (["--plugin", "mypkg.boom"], "--plugin: 'mypkg.boom': importing module 'mypkg.boom' raised RuntimeError"),
    (["--plugin", "mypkg.strategies:build"], "--plugin: 'mypkg.strategies:build' is not a module name"),
    (["plugins=[nopkg_xyz]"], "plugins: 'nopkg_xyz': cannot import module 'nopkg_xyz'"),
    (["strategy.name=server_step"], "unknown strategy 'server_step'"),  # without --plugin
    (["strategy.name=mypkg.strat-egies:build"], "strategy.name='mypkg.strat-egies:build': not an import path"),
])
def test_bad_user_code_exits_2_with_one_line(argv, needle, userpkg, capsys, tracking_uri, in_tmp) -> None:
    code = main(["run", "fedavg_digits", *argv, "--tracking-uri", tracking_uri])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert needle in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not (in_tmp / "mlflow.db").exists()  # nothing half-written


def test_error_of_the_fedsim_command_is_one_line(userpkg, tracking_uri, tmp_path) -> None:
    """The same through the ``fedsim`` process (its own stderr, its own exit code)."""
    proc = fedsim_run(["fedavg_digits", "strategy.name=mypkg.boom:build"], tracking_uri, tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "raised RuntimeError: boom at import" in err and "boom.py:2" in err


# -- the registry's own rules -----------------------------------------------------------------------------
def test_params_dataclass_from_annotation_or_attribute(userpkg) -> None:
    from mypkg.models import TinyParams
    from mypkg.strategies import Params

    assert registry.STRATEGIES.params("mypkg.strategies:build", {"server_lr": 0.25}, "strategy.params") == Params(0.25)
    assert registry.MODELS.entry("mypkg.models:tiny").params is TinyParams

    def build(ctx, params):
        return None

    build.params = Params
    mod = importlib.import_module("mypkg.bad")
    mod.with_attr = build
    assert registry.STRATEGIES.entry("mypkg.bad:with_attr").params is Params
    mod.no_params = lambda ctx, params: None
    with pytest.raises(registry.ConfigError, match="takes no params"):
        registry.STRATEGIES.params("mypkg.bad:no_params", {"x": 1}, "strategy.params")


def test_plugins_reach_engine_processes_through_the_runspec(userpkg) -> None:
    """A fresh process (a Ray actor, a Flower client) rebuilds the config from the RunSpec's YAML and
    imports its plugins before it looks a name up."""
    script = textwrap.dedent("""
        from fedsim import config as C
        from fedsim.engine.runtime import RunSpec
        from fedsim.registry import MODELS

        cfg = C.ExperimentConfig(plugins=["mypkg.model_plugin"])
        assert "user_tiny" not in MODELS
        spec = RunSpec(C.to_yaml(cfg))
        assert spec.cfg.plugins == ["mypkg.model_plugin"] and "user_tiny" in MODELS
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=userpkg.parent)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.parametrize(("command", "runner"), [
    (["sweep", "fedavg_digits", "--grid", "client.lr=0.01,0.05"], "fedsim.sweep.run_sweep"),
    (["reproduce", "fedavg_alpha"], "fedsim.reproduce.run_claim"),
])
def test_sweep_and_reproduce_pass_plugins_to_every_run(command, runner, userpkg, monkeypatch, capsys, in_tmp) -> None:
    """``--plugin`` on ``sweep`` / ``reproduce`` is imported first and becomes the override
    ``plugins=[...]`` of every run, so the Ray Tune trials import it too."""
    from fedsim import config as C
    from fedsim.errors import FedsimError

    seen = {}

    def stop(name, spec, **kw):
        seen["overrides"] = list(spec.overrides)
        raise FedsimError("stopped before running")

    module, _, attr = runner.rpartition(".")
    monkeypatch.setattr(importlib.import_module(module), attr, stop)
    assert main([*command, "--plugin", "mypkg.plugins", "--plugin", "mypkg.model_plugin"]) == 2
    assert "stopped before running" in capsys.readouterr().err
    assert seen["overrides"][-1] == 'plugins=["mypkg.plugins", "mypkg.model_plugin"]'
    assert "server_step" in registry.STRATEGIES and "user_tiny" in registry.MODELS
    cfg = C.load_config("fedavg_digits", [seen["overrides"][-1], "strategy.name=server_step"])
    assert cfg.plugins == ["mypkg.plugins", "mypkg.model_plugin"]



def test_plugin_flag_adds_to_the_experiment_files_plugins(userpkg, monkeypatch, capsys) -> None:
    """``sweep mine.yaml --plugin mypkg.plugins`` keeps the file's ``plugins: [mypkg.model_plugin]``
    (its model is registered there): the flag adds to the list, as ``fedsim run --plugin`` does,
    instead of replacing it."""
    from fedsim import sweep
    from fedsim.errors import FedsimError

    seen = {}

    def stop(name, spec, **kw):
        seen["overrides"] = list(spec.overrides)
        raise FedsimError("stopped before running")

    monkeypatch.setattr(sweep, "run_sweep", stop)
    experiment = str(userpkg / "mine.yaml")
    assert main(["sweep", experiment, "--grid", "client.lr=0.01,0.05", "--plugin", "mypkg.plugins"]) == 2
    assert "stopped before running" in capsys.readouterr().err
    assert seen["overrides"][-1] == 'plugins=["mypkg.model_plugin", "mypkg.plugins"]'
