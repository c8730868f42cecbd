"""Typed experiment configuration: OmegaConf structured configs over dataclasses.

An experiment YAML is merged onto :class:`ExperimentConfig`; unknown keys and wrong types are
errors that name the key.  Component-specific settings live in each section's ``params`` mapping
and are validated against the params dataclass the component registered (see
:mod:`fedsim.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import math

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedsim.errors import ConfigError
from fedsim.registry import DATASETS, ENGINES, LEARNERS, MODELS, PARTITIONERS, STRATEGIES, import_plugins
from fedsim.validation import check_fields, check_interpolations, rng, text

EXPERIMENTS_DIR = Path(__file__).resolve().parent.parent / "experiments"


@dataclass
class PartitionConfig:
    """How the training pool is split over clients (Flower Datasets partitioners, :mod:`envs.partition`).

    Every parameter defaults to None, "this partitioner's default"; :data:`PARTITION_PARAMS` says
    which partitioner uses which, and setting one that the chosen partitioner does not use is an error.
    """

    name: str = "dirichlet"  # see PARTITION_PARAMS: iid | dirichlet | inner_dirichlet | pathological | shard | ...
    alpha: Optional[float] = rng("(0, 1e6]", None)  # dirichlet, inner_dirichlet (0.5): smaller = more label skew
    min_partition_size: Optional[int] = rng("[1, 1e6]", None)  # dirichlet (10): redraw until every client has this many
    self_balancing: Optional[bool] = None  # dirichlet (false): Flower Datasets' self-balancing option
    num_classes_per_partition: Optional[int] = rng("[1, 1e6]", None)  # pathological, distribution (2)
    num_shards_per_partition: Optional[int] = rng("[1, 1e6]", None)  # shard (2)
    partition_sizes: Optional[list[int]] = None  # size (required), inner_dirichlet: one size per client
    size_law: Optional[str] = None  # inner_dirichlet (equal): equal | linear | square | exponential client sizes
    distribution_array: Optional[list[list[float]]] = None  # distribution (required): per class, per bucket
    preassigned_num_samples_per_label: Optional[int] = rng("[0, 1e6]", None)  # distribution (0)
    rescale: Optional[bool] = None  # distribution (true): scale each class's row to its size in the pool


#: Which :class:`PartitionConfig` fields each built-in partitioner uses (data, so validation imports
#: nothing; tests/fedsim/test_config_partition.py checks it against what envs.partition registers).
PARTITION_PARAMS: dict[str, tuple[str, ...]] = {
    "iid": (),
    "dirichlet": ("alpha", "min_partition_size", "self_balancing"),
    "inner_dirichlet": ("alpha", "partition_sizes", "size_law"),
    "pathological": ("num_classes_per_partition",),
    "shard": ("num_shards_per_partition",),
    "linear": (),
    "square": (),
    "exponential": (),
    "size": ("partition_sizes",),
    "distribution": ("distribution_array", "num_classes_per_partition", "preassigned_num_samples_per_label", "rescale"),
}
#: The fields a partitioner cannot do without (it has no default for them).
PARTITION_REQUIRED: dict[str, tuple[str, ...]] = {"size": ("partition_sizes",), "distribution": ("distribution_array",)}
SIZE_LAWS = ("equal", "linear", "square", "exponential")


@dataclass
class DataConfig:
    name: str = "mnist"  # registry key: mnist | digits | synthetic
    test_fraction: float = rng("(0, 1)", 0.2)  # held out before partitioning, for server-side evaluation
    client_test_fraction: float = rng("[0, 1)", 0.2)  # of each client's partition, for client-side evaluation
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    params: dict[str, Any] = field(default_factory=dict)  # dataset-specific (validated by its loader)


@dataclass
class ModelConfig:
    name: str = "mlp"  # registry key: mlp | cnn
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class ClientConfig:
    """The node-side learner and its local optimisation."""

    learner: str = "supervised"  # registry key
    optimizer: str = "sgd"  # sgd | adam
    lr: float = rng("(0, inf)", 0.05)  # a big finite lr is caught at run time (non-finite loss)
    momentum: float = rng("[0, 1]", 0.0)
    weight_decay: float = rng("[0, inf)", 0.0)
    batch_size: int = rng("[1, 1e6]", 32)
    local_epochs: int = rng("[1, 1e4]", 1)
    local_steps: Optional[int] = rng("[1, 1e7]", None)  # if set, exactly this many optimizer steps instead of epochs
    params: dict[str, Any] = field(default_factory=dict)  # learner-specific


@dataclass
class StrategyConfig:
    name: str = "fedavg"  # registry key
    fraction_train: float = rng("(0, 1]", 1.0)  # share of clients sampled for training each round
    fraction_evaluate: float = rng("[0, 1]", 0.0)  # share sampled for client-side evaluation (0 = server eval only)
    # Fewest successful training replies a round may have; fewer fails the run.  Failed clients
    # are always counted and logged; by default any round with >= 1 result is aggregated (as
    # Flower's FedAvg does).  Set it to the sample size to fail on any client failure.
    min_train_results: int = rng("[1, 1e6]", 1)
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class FlowerEngineConfig:
    """Settings of Flower's simulation runtime (Ray backend)."""

    client_num_cpus: float = rng("(0, 1024]", 1.0)
    client_num_gpus: float = rng("[0, 64]", 0.0)
    ray_num_cpus: Optional[int] = rng("[1, 4096]", None)  # CPUs Ray may use; None = all of this machine's
    address: Optional[str] = None  # "auto" / "host:port" / "ray://host:port" joins a cluster; None: $RAY_ADDRESS, else a local Ray
    timeout_s: float = rng("(0, 1e6]", 900.0)  # whole-simulation limit, so a mis-sized request cannot hang forever


@dataclass
class ResourceHint:
    """Ray resources of the actor that serves a particular client (``engine.ray.client_resources``)."""

    num_cpus: float = rng("(0, 1024]", 1.0)
    num_gpus: float = rng("[0, 64]", 0.0)


@dataclass
class RayEngineConfig:
    """fedsim's own pool of long-lived Ray actors (``engine.name=ray``)."""

    num_actors: Optional[int] = rng("[1, 1e5]", None)  # None: as many as fit (Ray's CPUs / actor_num_cpus)
    actor_num_cpus: float = rng("(0, 1024]", 1.0)
    actor_num_gpus: float = rng("[0, 64]", 0.0)  # a GPU fraction per actor, e.g. 0.25 packs four actors on one GPU
    address: Optional[str] = None  # "auto" / "ray://host:port" joins a cluster; None: $RAY_ADDRESS, else a local Ray
    ray_num_cpus: Optional[int] = rng("[1, 4096]", None)  # a local Ray only: CPUs it may use (None = all of this machine's)
    # Calls one Ray task carries to an actor: a round's calls for one actor go in batches of this many
    # (a task round trip per batch, not per call; bench_ray_scaleout.py: 2.9x faster rounds for a tiny
    # MLP); each call keeps its own budget, enforced inside the actor.  1: one task per call.
    calls_per_task: int = rng("[1, 1e6]", 16)
    # Per-client resource hints, by partition id ("3": {num_cpus: 2, num_gpus: 0.5}); such clients are
    # served by dedicated long-lived actors of that size, every other client by the shared pool.
    client_resources: dict[str, ResourceHint] = field(default_factory=dict)


@dataclass
class SystemConfig:
    """Simulated system heterogeneity, in simulated (not slept) time.

    Each client has a fixed seeded speed factor s_k ~ LogNormal(0, speed_sigma); a round of local work
    takes ``work_k * seconds_per_step / s_k + latency_s`` simulated seconds (work_k = its local steps).
    Each sampled client is unavailable in a round with probability ``dropout``.  With a ``deadline_s``
    the replies that would arrive later are dropped (stragglers) and never computed.
    """

    enabled: bool = False
    seconds_per_step: float = rng("(0, 1e6]", 0.05)
    speed_sigma: float = rng("[0, 100]", 0.5)
    latency_s: float = rng("[0, 1e6]", 0.0)
    dropout: float = rng("[0, 1)", 0.0)
    deadline_s: Optional[float] = rng("(0, 1e9]", None)


@dataclass
class FaultConfig:
    """Fault injection (to test resilience).

    Listed partitions raise inside their ClientApp; besides, a seeded share of the training calls
    raises (``raise_fraction``) or hangs for ``hang_s`` (``hang_fraction``, caught by the client
    timeout).  ``transient`` faults strike the first attempt only, so retries recover them.
    """

    fail_partitions: list[int] = field(default_factory=list)
    fail_rounds: list[int] = field(default_factory=list)  # empty = every round
    raise_fraction: float = rng("[0, 1]", 0.0)
    hang_fraction: float = rng("[0, 1]", 0.0)
    hang_s: float = rng("(0, 1e6]", 3600.0)
    transient: bool = False


@dataclass
class EngineConfig:
    name: str = "local"  # local | ray | flower
    threads_per_client: int = rng("[1, 1024]", 1)  # torch threads inside a client call (same in every engine)
    device: str = "cpu"  # cpu | auto | cuda | cuda:N: where learners keep model and data (fedsim/device.py)
    round_timeout_s: float = rng("(0, 1e6]", 600.0)  # how long the server waits for the replies of one round
    # Per-client deadline: each call gets min(client_timeout_s, round_timeout_s) from its own start
    # (clients of a round run in parallel in simulation); a longer call is a failed client (timeout),
    # the others run. None = round_timeout_s: a client has as long as the round.
    client_timeout_s: Optional[float] = None
    retries: int = rng("[0, 100]", 0)  # resend a failed client's message (exception or timeout) up to this many times
    # Train a round's cohort together with torch.func (local engine; the sequential result to float
    # tolerance): true where it is exact, auto where it is exact and measured faster, false never.
    vectorise: Union[bool, str] = "auto"
    vectorise_chunk: int = rng("[1, 1e6]", 256)  # clients per vmap call (bounds memory)
    checkpoint: bool = True  # save the server state every round, so `fedsim run ... --resume RUN_ID` works
    checkpoint_dir: str = "fedsim-checkpoints"  # relative paths are under the working directory
    keep_checkpoint: bool = False  # keep it after a run finishes (e.g. to extend the run later)
    verbose: bool = False  # show Flower's and Ray's own logs
    flower: FlowerEngineConfig = field(default_factory=FlowerEngineConfig)
    ray: RayEngineConfig = field(default_factory=RayEngineConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)


@dataclass
class EvaluationConfig:
    server: bool = True  # evaluate the global model on the held-out test split
    # server evaluation cadence: rounds 0, every, 2*every, ... and always the last round
    every: int = rng("[1, 1e6]", 1)
    batch_size: int = rng("[1, 1e6]", 512)
    # share of the training pool held out (stratified, before partitioning) as a server validation
    # split, logged as val/accuracy, val/loss; what tuning selects on (0 = off, no split)
    validation_fraction: float = rng("[0, 1)", 0.0)


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: Optional[str] = None  # None: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db in the cwd
    experiment: str = text("fedsim", max_len=200, nonempty=True)  # MLflow experiment name
    log_model: bool = True  # store the final global weights as an artifact


@dataclass
class PrivacyConfig:
    """Differential privacy of the client learners (see privacy/)."""

    enabled: bool = False
    level: str = "sample"  # sample: DP-SGD inside each client (Opacus) | client: Flower's server-side DP wrapper
    epsilon: Optional[float] = rng("(0, 1e3]", None)  # target ε per client for the whole run (--eps)
    delta: float = rng("(0, 1)", 1e-5)
    noise_multiplier: Optional[float] = rng("(0, 1e6]", None)  # set σ directly instead of calibrating it from epsilon
    max_grad_norm: float = rng("(0, 1e6]", 1.0)  # per-sample clipping bound C
    accountant: str = "prv"  # prv | rdp
    # standard: also release, without DP, train losses, client sizes, label plots (privacy/release.py);
    # strict: withhold them (ledger keys only in replies, uniform weights, no setup facts)
    release: str = "standard"
    grad_sample_mode: str = "hooks"  # Opacus per-sample-gradient mode: hooks | ew | functorch | ghost
    max_physical_batch_size: int = rng("[1, 1e6]", 64)  # logical batches are split to this size (memory)
    update_clipping_norm: float = rng("(0, 1e6]", 1.0)  # client level: each client's model update is clipped to this L2 norm


@dataclass
class ExperimentConfig:
    name: str = text("fedavg", max_len=200, nonempty=True)
    description: str = text("", max_len=10_000)
    seed: int = rng("[0, 4294967295]", 0)  # numpy's seed range
    rounds: int = rng("[1, 1e5]", 3)
    num_clients: int = rng("[1, 1e5]", 10)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    # Modules imported (here and in every engine process) before any component name is looked up, so
    # their @STRATEGIES.register(...) etc. add names; `--plugin MODULE` appends one (docs/adding-a-strategy.md)
    plugins: list[str] = field(default_factory=list)


@dataclass
class CentralConfig:
    """A centralised-track experiment: one registered method (``central/``) with its typed params.

    Recognised by its top-level ``method:`` key.  ``params`` are validated against the method's
    params dataclass by the registry; ``quick`` asks for the method's fast default (tests, demos).
    """

    method: str = ""
    name: str = text("", max_len=200)
    description: str = text("", max_len=10_000)
    seed: int = rng("[0, 4294967295]", 0)
    params: dict[str, Any] = field(default_factory=dict)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


#: CLI short flags and the config keys they set.
FLAG_KEYS: dict[str, str] = {
    "rounds": "rounds",
    "clients": "num_clients",
    "seed": "seed",
    "engine": "engine.name",
}


def _omegaconf_error(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None)
    msg = str(exc).splitlines()[0].strip()
    msg = msg.replace("type hint 'Union[bool, str]'", "this key (true, false or a word such as auto)")
    where = f"{source}: key '{key}'" if key else source
    return ConfigError(f"{where}: {msg}")


def experiment_path(name_or_path: str) -> Path:
    """Resolve ``fedavg`` to ``experiments/fedavg.yaml``, or accept a path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"experiment file not found: {p}")
        return p
    candidate = EXPERIMENTS_DIR / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    known = ", ".join(list_experiments()) or "none"
    raise ConfigError(f"unknown experiment {name_or_path!r}; known: {known} (or pass a .yaml path)")


def list_experiments() -> list[str]:
    return sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml"))


def read_yaml(path: Path) -> dict[str, Any]:
    """A UTF-8 YAML mapping, with no resolver interpolations in it (one-line errors otherwise)."""
    try:
        raw = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (bad byte at offset {exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc}); pass a readable YAML file") from None
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: bad YAML{at}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: YAML nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: an experiment file must be a mapping of keys, got {type(data).__name__}")
    check_interpolations(data, f"{path}: ")
    return data


def is_central(name_or_path: str) -> bool:
    """True when the experiment file is a centralised-track one (it names a ``method``)."""
    return "method" in read_yaml(experiment_path(name_or_path))


def load_central_config(name_or_path: str, overrides: list[str] | None = None, seed: int | None = None) -> CentralConfig:
    """Load a centralised-track experiment with ``key=value`` overrides (``params.*`` checked later)."""
    path = experiment_path(name_or_path)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(CentralConfig), read_yaml(path))
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(exc, str(path)) from None
    if not cfg.name:
        cfg.name = path.stem
    cfg = _apply_overrides(cfg, overrides, example="params.steps=100", settings={"seed": seed})
    typed: CentralConfig = _resolve(cfg)
    _check(bool(typed.method), f"{path}: 'method' must name a centralised method")
    check_fields(typed)
    return typed


#: Keys that existed once: setting one is a one-line error that says why it went.
REMOVED_KEYS: dict[str, str] = {
    "privacy.amplify_client_sampling": (
        "it folded the client-sampling fraction into every DP-SGD step's sampling rate, which is not a sound "
        "bound (a client takes part in whole rounds, and Flower samples clients without replacement); every "
        "client is now charged for every round, which is"),
}


def _check_removed(keys: list[str], where: str) -> None:
    for key in keys:
        if key in REMOVED_KEYS:
            raise ConfigError(f"{where}: {key} was removed: {REMOVED_KEYS[key]}; drop it")


def _dotted_keys(tree: Any, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict):
        return []
    out = []
    for key, value in tree.items():
        out.append(f"{prefix}{key}")
        out += _dotted_keys(value, f"{prefix}{key}.")
    return out


def load_config(
    name_or_path: str,
    overrides: list[str] | None = None,
    flags: dict[str, Any] | None = None,
) -> ExperimentConfig:
    """Load an experiment, apply ``key=value`` overrides then CLI flags, validate, return it typed."""
    path = experiment_path(name_or_path)
    base = OmegaConf.structured(ExperimentConfig)
    _check_removed(_dotted_keys(read_yaml(path)), str(path))
    _check_removed([item.split("=", 1)[0].strip() for item in overrides or []], "override")
    try:
        cfg = OmegaConf.merge(base, read_yaml(path))
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(exc, str(path)) from None
    if "name" not in read_yaml(path):
        cfg.name = path.stem
    settings = {FLAG_KEYS[flag]: value for flag, value in (flags or {}).items()}
    cfg = _drop_switched_partition_keys(cfg, overrides)
    cfg = _apply_overrides(cfg, overrides, example="client.lr=0.05", settings=settings)
    typed: ExperimentConfig = _resolve(cfg)
    validate(typed)
    return typed


def _resolve(cfg: DictConfig) -> Any:
    """The typed object, every ``${a.b}`` resolved now (an unresolvable one is a one-line error)."""
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        err = _omegaconf_error(exc, "config")
        if "nterpolation" in str(err):
            err = ConfigError(f"{err}; an interpolation ${{a.b}} must name an existing config key")
        raise err from None


def _apply_overrides(
    cfg: Any,
    overrides: list[str] | None,
    example: str,
    settings: dict[str, Any],
) -> Any:
    """Merge ``key=value`` overrides, then the ``settings`` (config key -> value, e.g. from CLI
    flags) that are not None, into ``cfg``.

    Every override must name an existing key (or one under an open mapping such as ``params``);
    a bad one is a one-line :class:`ConfigError` quoting ``example``.
    """
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"bad override {item!r}: use key=value, e.g. {example}")
        key, value = item.split("=", 1)
        if not key.strip():
            raise ConfigError(f"bad override {item!r}: use key=value, e.g. {example}")
        check_interpolations(value, f"override {key}")
        node = OmegaConf.select(cfg, key, default="__missing__")
        if isinstance(node, str) and node == "__missing__" and not _inside_params(key):
            raise ConfigError(f"bad override {item!r}: no config key '{key}' (see --print-config)")
        if OmegaConf.is_dict(node) and not value.lstrip().startswith("{") and not _inside_params(key):
            raise ConfigError(f"bad override {item!r}: '{key}' is a section; set its keys (e.g. {key}.KEY=VALUE)")
    try:
        for item in overrides or []:  # one at a time, so a value that is not YAML names its override
            cfg = OmegaConf.merge(cfg, _dotlist_item(item))
        for key, value in settings.items():
            if value is not None:
                OmegaConf.update(cfg, key, value, merge=True)
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(exc, "override") from None
    except ValueError as exc:  # e.g. from_dotlist on a malformed item
        raise ConfigError(f"bad override: {exc}") from None
    return cfg


def _dotlist_item(item: str) -> DictConfig:
    """One ``key=value`` override as a config; a value YAML cannot read is a one-line error."""
    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(f"bad override {item[:200]!r}: its value is not valid YAML ({problem}); quote it, "
                          f"e.g. 'name=\"my run\"'") from None


#: Mappings whose keys the user chooses (their values are still typed or validated later).
OPEN_MAPPINGS = (".params.", ".engine.ray.client_resources.")


def _inside_params(key: str) -> bool:
    """Keys under a ``params`` mapping are validated later, by the component that owns them."""
    return any(m in f".{key}" for m in OPEN_MAPPINGS)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: ExperimentConfig) -> None:
    """The declared field ranges (:func:`fedsim.validation.check_fields`), then cross-field checks."""
    check_fields(cfg)
    import_plugins(cfg.plugins)  # before any name is looked up: they register names
    _check(cfg.engine.name in ENGINES,
           f"engine must be one of {', '.join(ENGINES.names())}, got {cfg.engine.name!r}")
    check_names(cfg)
    validate_partition(cfg.data.partition, cfg.num_clients)
    _check(cfg.client.optimizer in ("sgd", "adam"), f"client.optimizer must be 'sgd' or 'adam', got {cfg.client.optimizer!r}")
    _check(cfg.strategy.fraction_evaluate == 0 or cfg.data.client_test_fraction > 0,
           f"strategy.fraction_evaluate={cfg.strategy.fraction_evaluate} asks for client-side evaluation but "
           f"data.client_test_fraction=0 leaves the clients no test data; raise data.client_test_fraction "
           f"or set strategy.fraction_evaluate=0")
    validate_engine(cfg.engine)
    validate_privacy(cfg.privacy)
    _check(not (cfg.privacy.enabled and cfg.privacy.release == "strict" and cfg.strategy.fraction_evaluate > 0),
           f"privacy.release=strict withholds metrics on the clients' own data, but strategy.fraction_evaluate="
           f"{cfg.strategy.fraction_evaluate} asks for client-side evaluation; set strategy.fraction_evaluate=0")


def check_names(cfg: ExperimentConfig) -> None:
    """Every component the config names is registered; answered from the plugin manifest, importing nothing
    but the config's ``plugins`` and the modules of its import-path names (``module:attr``)."""
    import_plugins(cfg.plugins)
    for registry, name in ((DATASETS, cfg.data.name), (PARTITIONERS, cfg.data.partition.name),
                           (MODELS, cfg.model.name), (LEARNERS, cfg.client.learner), (STRATEGIES, cfg.strategy.name)):
        registry.require(name)


#: The partition parameters (every PartitionConfig field but ``name``).
PARTITION_KEYS = ("alpha", "min_partition_size", "self_balancing", "num_classes_per_partition",
                  "num_shards_per_partition", "partition_sizes", "size_law", "distribution_array",
                  "preassigned_num_samples_per_label", "rescale")


def validate_partition(p: PartitionConfig, num_clients: int) -> None:
    """A set parameter that the partitioner does not use is an error, and so is a missing required one.

    A partitioner outside :data:`PARTITION_PARAMS` (a plugin's) checks its own settings.
    """
    uses = PARTITION_PARAMS.get(p.name)
    if uses is None:
        return
    for key in PARTITION_KEYS:
        if getattr(p, key) is not None and key not in uses:
            first, *others = [n for n, u in PARTITION_PARAMS.items() if key in u]
            also = f" (or {', '.join(others)})" if others else ""
            raise ConfigError(f"data.partition.{key}: partitioner {p.name!r} does not use it (it uses: "
                              f"{', '.join(uses) or 'none'}); remove it or set data.partition.name={first}{also}")
    for key in PARTITION_REQUIRED.get(p.name, ()):
        _check(getattr(p, key) is not None,
               f"data.partition.{key}: partitioner {p.name!r} needs it (it has no default); set it")
    sizes = p.partition_sizes
    if sizes is not None:
        _check(len(sizes) == num_clients, f"data.partition.partition_sizes: {len(sizes)} sizes for "
               f"num_clients={num_clients}; give one size per client")
        _check(min(sizes) >= 1, f"data.partition.partition_sizes: every size must be >= 1 (every client needs "
               f"data), got {min(sizes)}")
        _check(p.size_law is None, "data.partition.size_law: set either partition_sizes or size_law, not both")
    _check(p.size_law is None or p.size_law in SIZE_LAWS,
           f"data.partition.size_law must be one of {', '.join(SIZE_LAWS)}, got {p.size_law!r}")
    arr = p.distribution_array
    if arr is not None:
        _check(len(arr) > 0 and len(arr[0]) > 0 and all(len(row) == len(arr[0]) for row in arr),
               "data.partition.distribution_array must be a non-empty rectangular list of rows (one per class)")
        _check(all(math.isfinite(v) and v >= 0 for row in arr for v in row),
               "data.partition.distribution_array: every value must be finite and >= 0")


def _drop_switched_partition_keys(cfg: DictConfig, overrides: list[str] | None) -> DictConfig:
    """Overrides that name another partitioner than the experiment file drop the file's partition
    keys that the new one does not use (they were the old one's); keys the overrides set are kept
    and checked by :func:`validate_partition`."""
    if not any(item.split("=", 1)[0].strip().startswith("data.partition") for item in overrides or []):
        return cfg
    probe = _apply_overrides(cfg, overrides, example="client.lr=0.05", settings={})
    old, new = cfg.data.partition.name, probe.data.partition.name
    if new == old or new not in PARTITION_PARAMS:
        return cfg
    for key in PARTITION_KEYS:
        if key not in PARTITION_PARAMS[new]:
            cfg.data.partition[key] = None
    return cfg


def validate_engine(e: EngineConfig) -> None:
    """Engine checks beyond the declared ranges."""
    _check(e.client_timeout_s is None or (math.isfinite(e.client_timeout_s) and e.client_timeout_s > 0),
           f"engine.client_timeout_s must be a finite number > 0 when set, got {e.client_timeout_s}")
    _check(e.vectorise in (True, False, "auto"),
           f"engine.vectorise must be true, false or auto, got {e.vectorise!r}")
    from fedsim.device import check_device_name

    check_device_name(e.device)
    for pid in e.ray.client_resources:
        _check(pid.isdigit(), f"engine.ray.client_resources: keys are partition ids, got {pid!r}")
    f = e.faults
    _check(f.raise_fraction + f.hang_fraction <= 1,
           "engine.faults.raise_fraction and hang_fraction must sum to at most 1")


def validate_privacy(p: PrivacyConfig) -> None:
    """Privacy checks beyond the declared ranges (only when privacy is on)."""
    if not p.enabled:
        return
    _check(p.level in ("sample", "client"), f"privacy.level must be 'sample' or 'client', got {p.level!r}")
    _check(p.accountant in ("prv", "rdp"), f"privacy.accountant must be 'prv' or 'rdp', got {p.accountant!r}")
    _check(p.grad_sample_mode in ("hooks", "ew", "functorch", "ghost"),
           f"privacy.grad_sample_mode must be hooks, ew, functorch or ghost, got {p.grad_sample_mode!r}")
    _check((p.epsilon is None) != (p.noise_multiplier is None),
           "privacy: set exactly one of privacy.epsilon (--eps) and privacy.noise_multiplier")
    _check(p.release in ("standard", "strict"), f"privacy.release must be 'standard' or 'strict', got {p.release!r}")


def to_container(cfg: ExperimentConfig) -> dict[str, Any]:
    """Plain nested dict (picklable, YAML-able)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


_yaml_of: dict[str, str] = {}  # repr(cfg) -> its YAML (bounded: cleared past _YAML_CACHE entries)
_YAML_CACHE = 256


def to_yaml(cfg: ExperimentConfig) -> str:
    """The config as YAML text (OmegaConf's, validated against the schema).

    Memoised on the dataclass's ``repr``, which spells every field's value and type: building the
    structured config costs ~15 ms, a twentieth of a 100-client run, and a run converts the same config
    more than once (its RunSpec, the logged config.yaml, a sweep's trials)."""
    key = repr(cfg)
    text = _yaml_of.get(key)
    if text is None:
        text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
        if len(_yaml_of) >= _YAML_CACHE:
            _yaml_of.clear()
        _yaml_of[key] = text
    return text


def from_container(data: dict[str, Any]) -> ExperimentConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ExperimentConfig), data))  # type: ignore[return-value]


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (for MLflow params)."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def as_dictconfig(cfg: ExperimentConfig) -> DictConfig:
    return OmegaConf.structured(cfg)
