"""``fedsim export NAME DIR``: an experiment as a standalone Flower app that ``flwr run`` executes.

The app is a directory with a ``pyproject.toml`` (``[tool.flwr.app]``: publisher, components, run
config; ``[tool.flwr.federations]``: a local-simulation federation of ``num_clients`` SuperNodes),
a ``README.md`` and a small package ``<pkg>/`` holding ``config.yaml`` (the resolved experiment),
``server_app.py`` and ``client_app.py``.  The two modules are three lines each: they import fedsim
(a dependency of the app, which must be installed where the app runs) and call
:func:`exported_server_app` / :func:`exported_client_app`, which build the same ServerApp body
(:func:`fedsim.engine.server.run_server`, the registered strategy builder) and the same ClientApp
(:func:`fedsim.engine.runtime.build_client_app`, the registered learner) as the ``flower`` engine.

Run config (``[tool.flwr.app.config]``, changed with ``flwr run DIR --run-config KEY=VALUE``):

- ``num-server-rounds``: the rounds (the experiment's ``rounds``);
- ``seed``: the root seed;
- ``fedsim-config``: the experiment YAML, relative to the package (``config.yaml``);
- ``fedsim-overrides``: space-separated ``key=value`` overrides applied on top, e.g. ``"client.lr=0.05"``;
- ``results-file``: where the ServerApp writes the per-round metrics as JSON ("" = nowhere).

Server and clients read the same run config, so both see the same rounds, seed and overrides.
What only fedsim's runner does is not in the app: MLflow tracking, checkpoints and ``--resume``,
the privacy ledger's files and a learner's final report.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import threading
from pathlib import Path
from typing import Any, Mapping

from fedsim import config as C
from fedsim.errors import ConfigError

#: The run-config keys of an exported app (see the module docstring).
ROUNDS_KEY, SEED_KEY, CONFIG_KEY, OVERRIDES_KEY, RESULTS_KEY = (
    "num-server-rounds", "seed", "fedsim-config", "fedsim-overrides", "results-file")
FEDERATION = "local-simulation"
PUBLISHER = "fedsim"


# --------------------------------------------------------------------------------------- writing


def package_name(experiment: str) -> str:
    """The Python package of the exported app: ``fedavg_digits`` -> ``fedavg_digits_app``."""
    slug = re.sub(r"[^0-9a-zA-Z_]+", "_", experiment).strip("_").lower() or "experiment"
    if slug[0].isdigit():
        slug = f"x{slug}"
    return f"{slug}_app"


def export_config(name_or_path: str, overrides: list[str] | None = None, flags: dict[str, Any] | None = None,
                  plugins: list[str] | None = None) -> C.ExperimentConfig:
    """The experiment as the exported app will run it, after the checks that make an export fail."""
    C.experiment_path(name_or_path)  # unknown experiment: its one-line error
    if C.is_central(name_or_path):
        raise ConfigError(f"{name_or_path!r} is a centralised method (no clients, no rounds): there is no Flower "
                          f"app to export; `fedsim export` takes federated experiments")
    engine_flag = (flags or {}).get("engine")
    if engine_flag not in (None, "flower"):
        raise ConfigError(f"--engine {engine_flag}: an exported app runs on Flower's runtime (`flwr run`), "
                          f"not a fedsim engine; drop --engine")
    cfg = C.load_config(name_or_path, overrides, {k: v for k, v in (flags or {}).items() if k != "engine"})
    cfg.plugins = list(dict.fromkeys([*cfg.plugins, *(plugins or [])]))
    engine_only = engine_only_settings(cfg)
    if engine_only:
        raise ConfigError(f"{engine_only[0]} is a feature of fedsim's own engines that a Flower app cannot "
                          f"honour; drop it to export (`flwr run` sets resources and addresses itself)")
    cfg.engine.name = "flower"  # what the app is: Flower's runtime (the records say so)
    cfg.engine.checkpoint = False  # checkpoints and --resume belong to fedsim's runner
    cfg.tracking.enabled = False  # MLflow is the runner's too
    C.validate(cfg)
    from fedsim.engine.runtime import RunSpec
    from fedsim.runner import preflight

    preflight(RunSpec.from_config(cfg))  # unknown strategy / learner / params: fail now, not in `flwr run`
    return cfg


def engine_only_settings(cfg: C.ExperimentConfig) -> list[str]:
    """The settings of ``cfg`` that only a fedsim engine honours (an export refuses them)."""
    e, defaults = cfg.engine, C.EngineConfig()
    found = []
    if e.vectorise is True:
        found.append("engine.vectorise=true (the local engine's vectorised cohort)")
    if e.ray.address:
        found.append(f"engine.ray.address={e.ray.address} (the ray engine's cluster)")
    if e.flower.address:
        found.append(f"engine.flower.address={e.flower.address} (the flower engine's Ray cluster)")
    if e.ray.client_resources != defaults.ray.client_resources:
        found.append("engine.ray.client_resources (the ray engine's resource hints)")
    return found


def _toml_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid TOML basic string


def _fedsim_requirement() -> str:
    """``fedsim`` as the app's dependency: this checkout by path when fedsim runs from one, else the name."""
    import fedsim

    root = Path(fedsim.__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file():
        return f"fedsim @ {root.as_uri()}"
    return "fedsim"


def pyproject_text(cfg: C.ExperimentConfig, pkg: str) -> str:
    import flwr

    project = pkg.replace("_", "-")
    description = (f"fedsim experiment {cfg.name} as a Flower app: {cfg.strategy.name}, {cfg.rounds} rounds, "
                   f"{cfg.num_clients} clients")
    deps = [_fedsim_requirement(), f"flwr[simulation]=={flwr.__version__}"]
    fc = cfg.engine.flower
    return f"""# Exported by `fedsim export {cfg.name}`: a Flower app running fedsim's strategy and learner.
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = {_toml_string(project)}
version = "1.0.0"
description = {_toml_string(description)}
license = "Apache-2.0"
dependencies = [{", ".join(_toml_string(d) for d in deps)}]

[tool.hatch.build.targets.wheel]
packages = ["{pkg}"]

[tool.hatch.metadata]
allow-direct-references = true

[tool.flwr.app]
publisher = "{PUBLISHER}"

[tool.flwr.app.components]
serverapp = "{pkg}.server_app:app"
clientapp = "{pkg}.client_app:app"

[tool.flwr.app.config]
{ROUNDS_KEY} = {cfg.rounds}
{SEED_KEY} = {cfg.seed}
{CONFIG_KEY} = "config.yaml"
{OVERRIDES_KEY} = ""
{RESULTS_KEY} = ""

[tool.flwr.federations]
default = "{FEDERATION}"

[tool.flwr.federations.{FEDERATION}]
options.num-supernodes = {cfg.num_clients}
options.backend.client-resources.num-cpus = {fc.client_num_cpus:g}
options.backend.client-resources.num-gpus = {fc.client_num_gpus:g}
"""


def _module_text(cfg: C.ExperimentConfig, kind: str) -> str:
    factory = f"exported_{kind}_app"
    label = {"server": "ServerApp", "client": "ClientApp"}[kind]
    return (f'"""The {label} of the fedsim experiment {cfg.name!r}, exported by `fedsim export` (needs fedsim)."""\n\n'
            f"from pathlib import Path\n\n"
            f"from fedsim.export import {factory}\n\n"
            f"app = {factory}(Path(__file__).parent)\n")


def readme_text(cfg: C.ExperimentConfig, pkg: str) -> str:
    fc = cfg.engine.flower
    return f"""# {cfg.name}: a Flower app exported by fedsim

{(cfg.description or '').strip()}

Exported by `fedsim export` from the experiment `{cfg.name}` (the resolved config, overrides included, is
`{pkg}/config.yaml`). It runs fedsim's `{cfg.strategy.name}` strategy (built
by fedsim's registered builder) and the `{cfg.client.learner}` learner on Flower's runtime: the same
ServerApp body and ClientApp as `fedsim run {cfg.name} --engine flower`.

**fedsim must be installed** in the environment that runs the app (it is the app's dependency:
`{pkg}/server_app.py` and `{pkg}/client_app.py` import it).

## Files

- `pyproject.toml`: `[tool.flwr.app]` (components `{pkg}.server_app:app`, `{pkg}.client_app:app`; run
  config below) and a `{FEDERATION}` federation of {cfg.num_clients} SuperNodes.
- `{pkg}/config.yaml`: the resolved experiment ({cfg.rounds} rounds, {cfg.num_clients} clients, seed {cfg.seed}).
- `{pkg}/server_app.py`, `{pkg}/client_app.py`: build the ServerApp and ClientApp from it.

## Run it

```bash
# in the environment where fedsim is installed; no dependency download, no telemetry
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED=0
flwr run . --stream --federation-config "num-supernodes={cfg.num_clients} client-resources-num-cpus={fc.client_num_cpus:g}"
flwr run . --stream --run-config "num-server-rounds=2 seed=3" --federation-config "num-supernodes={cfg.num_clients}"
```

Flower 1.42 starts a local SuperLink in the background for `flwr run` (it keeps running; stop it
by its PID). It moves the `[tool.flwr.federations]` section into `$FLWR_HOME/config.toml` on the first
run and comments it out here; `--federation-config` sets the same things per run. Without
`FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1` the SuperLink installs the dependencies into a fresh
environment with uv (several GB: torch).

From Python: `flwr.simulation.run_simulation(server_app=..., client_app=..., num_supernodes={cfg.num_clients})`
with the `app` objects of the two modules.

## Run config

| key | default | meaning |
|---|---|---|
| `{ROUNDS_KEY}` | {cfg.rounds} | federated rounds |
| `{SEED_KEY}` | {cfg.seed} | root seed (every random stream derives from it) |
| `{CONFIG_KEY}` | `config.yaml` | the experiment YAML, relative to `{pkg}/` |
| `{OVERRIDES_KEY}` | "" | fedsim overrides, space-separated, e.g. `"client.lr=0.05 strategy.fraction_train=1.0"` |
| `{RESULTS_KEY}` | "" | write the per-round metrics there as JSON |

Each round's metrics are logged by the ServerApp (`flwr run --stream` shows them). Not in the app:
MLflow tracking, checkpoints and `--resume` (fedsim's runner does those: use `fedsim run`).
"""


#: The list of files an export wrote, kept in the app so that ``--force`` removes a previous export's
#: files (another experiment's package) before writing, and never touches files it did not write.
MANIFEST = ".fedsim-export"


def _remove_previous_export(dest: Path) -> None:
    manifest = dest / MANIFEST
    if not manifest.is_file():
        return
    root = dest.resolve()
    for line in manifest.read_text(encoding="utf-8").splitlines():
        path = (dest / line).resolve()
        if line and path.is_relative_to(root) and path.is_file():
            path.unlink()
            for parent in path.parents:  # the package directories it leaves empty
                if parent == root or not parent.is_relative_to(root) or any(parent.iterdir()):
                    break
                parent.rmdir()
    manifest.unlink()


def export_app(dest: str | Path, cfg: C.ExperimentConfig, *, force: bool = False) -> list[Path]:
    """Write the Flower app of ``cfg`` (from :func:`export_config`) into ``dest``; the files written.

    ``force`` writes into a non-empty ``dest``: the files of a previous export there (its
    :data:`MANIFEST`) are removed first, any other file is left alone.
    """
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"{dest} exists and is not a directory; pass a new or empty directory")
    if dest.is_dir() and any(dest.iterdir()) and not force:
        raise ConfigError(f"{dest} exists and is not empty; pass an empty directory, or --force to overwrite")
    pkg = package_name(cfg.name)
    files = {
        dest / "pyproject.toml": pyproject_text(cfg, pkg),
        dest / "README.md": readme_text(cfg, pkg),
        dest / pkg / "__init__.py": f'"""Flower app of the fedsim experiment {cfg.name!r}."""\n',
        dest / pkg / "config.yaml": C.to_yaml(cfg),
        dest / pkg / "server_app.py": _module_text(cfg, "server"),
        dest / pkg / "client_app.py": _module_text(cfg, "client"),
    }
    try:
        if force and dest.is_dir():
            _remove_previous_export(dest)
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        (dest / MANIFEST).write_text("".join(f"{p.relative_to(dest).as_posix()}\n" for p in files), encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write the app into {dest}: {exc.strerror or exc}") from None
    return list(files)


# --------------------------------------------------------------------------------------- running


_config_lock = threading.Lock()
_configs: dict[tuple[str, tuple[tuple[str, str], ...]], C.ExperimentConfig] = {}


def app_config(package_dir: str | Path, run_config: Mapping[str, Any]) -> C.ExperimentConfig:
    """The experiment of an exported app under Flower's ``run_config`` (empty: the exported values)."""
    key = (str(package_dir), tuple(sorted((str(k), repr(v)) for k, v in dict(run_config).items())))
    with _config_lock:
        if key in _configs:
            return _configs[key]
    path = Path(package_dir) / str(run_config.get(CONFIG_KEY) or "config.yaml")
    overrides = shlex.split(str(run_config.get(OVERRIDES_KEY) or ""))
    flags: dict[str, Any] = {}
    if run_config.get(ROUNDS_KEY) not in (None, ""):
        flags["rounds"] = int(run_config[ROUNDS_KEY])
    if run_config.get(SEED_KEY) not in (None, ""):
        flags["seed"] = int(run_config[SEED_KEY])
    from fedsim.registry import import_plugins

    import_plugins(list(C.read_yaml(path).get("plugins") or []))  # they register names the config uses
    cfg = C.load_config(str(path), overrides, flags)
    cfg.engine.name, cfg.engine.checkpoint, cfg.tracking.enabled = "flower", False, False
    with _config_lock:
        _configs[key] = cfg
    return cfg


class _RoundLog:
    """An observer that logs each round through Flower's logger (``flwr run --stream`` shows it)."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def on_round(self, record: Any) -> None:
        from logging import INFO

        from flwr.common.logger import log

        self.records.append(record)
        shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(record.metrics.items()) if "/" in k and
                          k.split("/")[0] in ("train", "eval", "fed_eval"))
        log(INFO, "[fedsim] round %d: %s", record.round, shown or "no metrics")


def _json_value(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)


def write_results(path: str | Path, cfg: C.ExperimentConfig, records: list[Any]) -> None:
    data = {"experiment": cfg.name, "strategy": cfg.strategy.name, "rounds": cfg.rounds, "seed": cfg.seed,
            "records": [{"round": r.round, "metrics": {k: _json_value(v) for k, v in r.metrics.items()},
                         "clients_ok": r.clients_ok, "clients_failed": r.clients_failed,
                         "failures": list(r.failures)} for r in records]}
    Path(path).write_text(json.dumps(data, indent=1), encoding="utf-8")


def exported_server_app(package_dir: str | Path) -> Any:
    """The ServerApp of an exported app: fedsim's round loop with the registered strategy.

    After a run, ``app.fedsim_records`` holds its :class:`~fedsim.contracts.history.RoundRecord` list
    (round 0 is the initial model), for callers that run it in-process (``run_simulation``).
    """
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    app = ServerApp()
    app.fedsim_records = []  # type: ignore[attr-defined]

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from fedsim.engine.flower import StoppableGrid
        from fedsim.engine.runtime import RunSpec, client_call_limit
        from fedsim.engine.server import run_server
        from fedsim.runner import preflight

        cfg = app_config(package_dir, context.run_config)  # Flower's runtime, Flower's logging: not quietened
        spec = RunSpec.from_config(cfg)
        preflight(spec)
        logger = _RoundLog()
        app.fedsim_records = logger.records  # type: ignore[attr-defined]
        run_server(StoppableGrid(grid, client_call_limit(cfg), threading.Event()), spec, [logger])
        results = str(context.run_config.get(RESULTS_KEY) or "")
        if results:
            write_results(results, cfg, logger.records)

    return app


def exported_client_app(package_dir: str | Path) -> Any:
    """The ClientApp of an exported app: fedsim's ClientApp of the run config's experiment.

    Flower gives the run config per message, so the inner app (``build_client_app``, as in the
    ``flower`` engine) is built for the config each message names, and kept while it stays the same.
    """
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

    app = ClientApp()
    inner: dict[str, Any] = {}

    def delegate(msg: Message, context: Context) -> Message:
        from fedsim.engine.runtime import RunSpec, build_client_app, client_call_limit

        cfg = app_config(package_dir, context.run_config)
        spec = RunSpec.from_config(cfg)
        if spec.config_yaml not in inner:
            inner.clear()
            inner[spec.config_yaml] = build_client_app(spec, deadline=client_call_limit(cfg))
        return inner[spec.config_yaml](msg, context)

    app.train()(delegate)
    app.evaluate()(delegate)
    app.query()(delegate)
    return app
