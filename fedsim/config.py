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

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedsim.errors import ConfigError

EXPERIMENTS_DIR = Path(__file__).resolve().parent.parent / "experiments"


@dataclass
class PartitionConfig:
    """How the training pool is split over clients (Flower Datasets partitioners)."""

    name: str = "dirichlet"  # iid | dirichlet | pathological | shard
    alpha: float = 0.5  # dirichlet concentration: smaller = more label skew
    min_partition_size: int = 10  # dirichlet: redraw until every client has this many examples
    self_balancing: bool = False  # dirichlet: Flower Datasets' self-balancing option
    num_classes_per_partition: int = 2  # pathological
    num_shards_per_partition: int = 2  # shard


@dataclass
class DataConfig:
    name: str = "mnist"  # registry key: mnist | digits | synthetic
    test_fraction: float = 0.2  # held out before partitioning, for server-side evaluation
    client_test_fraction: float = 0.2  # of each client's partition, for client-side evaluation
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
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    batch_size: int = 32
    local_epochs: int = 1
    local_steps: Optional[int] = None  # if set, exactly this many optimizer steps instead of epochs
    params: dict[str, Any] = field(default_factory=dict)  # learner-specific


@dataclass
class StrategyConfig:
    name: str = "fedavg"  # registry key
    fraction_train: float = 1.0  # share of clients sampled for training each round
    fraction_evaluate: float = 0.0  # share sampled for client-side evaluation (0 = server eval only)
    # Fewest successful training replies a round may have; fewer fails the run.  Failed clients
    # are always counted and logged; by default any round with >= 1 result is aggregated (as
    # Flower's FedAvg does).  Set it to the sample size to fail on any client failure.
    min_train_results: int = 1
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class FlowerEngineConfig:
    """Settings of Flower's simulation runtime (Ray backend)."""

    client_num_cpus: float = 1.0
    client_num_gpus: float = 0.0
    ray_num_cpus: Optional[int] = None  # CPUs Ray may use; None = all of this machine's
    address: Optional[str] = None  # Ray cluster address ("auto"); None = start a local Ray
    timeout_s: float = 900.0  # whole-simulation limit, so a mis-sized request cannot hang forever


@dataclass
class ResourceHint:
    """Ray resources of the actor that serves a particular client (``engine.ray.client_resources``)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0


@dataclass
class RayEngineConfig:
    """fedsim's own pool of long-lived Ray actors (``engine.name=ray``)."""

    num_actors: Optional[int] = None  # None: as many as fit (Ray's CPUs / actor_num_cpus)
    actor_num_cpus: float = 1.0
    actor_num_gpus: float = 0.0  # a GPU fraction per actor, e.g. 0.25 packs four actors on one GPU
    address: Optional[str] = None  # "auto" / "ray://host:port" joins a cluster; None: $RAY_ADDRESS, else a local Ray
    ray_num_cpus: Optional[int] = None  # a local Ray only: CPUs it may use (None = all of this machine's)
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
    seconds_per_step: float = 0.05
    speed_sigma: float = 0.5
    latency_s: float = 0.0
    dropout: float = 0.0
    deadline_s: Optional[float] = None


@dataclass
class FaultConfig:
    """Fault injection (to test resilience).

    Listed partitions raise inside their ClientApp; besides, a seeded share of the training calls
    raises (``raise_fraction``) or hangs for ``hang_s`` (``hang_fraction``, caught by the client
    timeout).  ``transient`` faults strike the first attempt only, so retries recover them.
    """

    fail_partitions: list[int] = field(default_factory=list)
    fail_rounds: list[int] = field(default_factory=list)  # empty = every round
    raise_fraction: float = 0.0
    hang_fraction: float = 0.0
    hang_s: float = 3600.0
    transient: bool = False


@dataclass
class EngineConfig:
    name: str = "local"  # local | ray | flower
    threads_per_client: int = 1  # torch threads inside a client call (same in every engine)
    round_timeout_s: float = 600.0  # how long the server waits for the replies of one round
    # A client call that runs longer counts as failed (timeout); None = round_timeout_s.
    client_timeout_s: Optional[float] = None
    retries: int = 0  # resend a failed client's message (exception or timeout) up to this many times
    # Train a round's cohort together with torch.func (local engine; the sequential result to float
    # tolerance): true where it is exact, auto where it is exact and measured faster, false never.
    vectorise: Union[bool, str] = "auto"
    vectorise_chunk: int = 256  # clients per vmap call (bounds memory)
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
    server: bool = True  # evaluate the global model on the held-out test split every round
    batch_size: int = 512


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: Optional[str] = None  # None: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db in the cwd
    experiment: str = "fedsim"  # MLflow experiment name
    log_model: bool = True  # store the final global weights as an artifact


@dataclass
class PrivacyConfig:
    """Differential privacy of the client learners (see privacy/)."""

    enabled: bool = False
    level: str = "sample"  # sample: DP-SGD inside each client (Opacus) | client: Flower's server-side DP wrapper
    epsilon: Optional[float] = None  # target ε per client for the whole run (--eps)
    delta: float = 1e-5
    noise_multiplier: Optional[float] = None  # set σ directly instead of calibrating it from epsilon
    max_grad_norm: float = 1.0  # per-sample clipping bound C
    accountant: str = "prv"  # prv | rdp
    # The authors' FedSVD code folds the client-sampling fraction into the sampling rate (privacy
    # amplification by secret client sampling). Off by default: a client is assumed to take part
    # in every round.
    amplify_client_sampling: bool = False
    grad_sample_mode: str = "hooks"  # Opacus per-sample-gradient mode: hooks | ew | functorch | ghost
    max_physical_batch_size: int = 64  # logical batches are split to this size (memory)
    update_clipping_norm: float = 1.0  # client level: each client's model update is clipped to this L2 norm


@dataclass
class ExperimentConfig:
    name: str = "fedavg"
    description: str = ""
    seed: int = 0
    rounds: int = 3
    num_clients: int = 10
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)


@dataclass
class CentralConfig:
    """A centralised-track experiment: one registered method (``central/``) with its typed params.

    Recognised by its top-level ``method:`` key.  ``params`` are validated against the method's
    params dataclass by the registry; ``quick`` asks for the method's fast default (tests, demos).
    """

    method: str = ""
    name: str = ""
    description: str = ""
    seed: int = 0
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
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: bad YAML{at}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: an experiment file must be a mapping of keys, got {type(data).__name__}")
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
    typed: CentralConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    _check(bool(typed.method), f"{path}: 'method' must name a centralised method")
    _check(typed.seed >= 0, f"seed must be >= 0, got {typed.seed}")
    return typed


def load_config(
    name_or_path: str,
    overrides: list[str] | None = None,
    flags: dict[str, Any] | None = None,
) -> ExperimentConfig:
    """Load an experiment, apply ``key=value`` overrides then CLI flags, validate, return it typed."""
    path = experiment_path(name_or_path)
    base = OmegaConf.structured(ExperimentConfig)
    try:
        cfg = OmegaConf.merge(base, read_yaml(path))
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(exc, str(path)) from None
    if "name" not in read_yaml(path):
        cfg.name = path.stem
    settings = {FLAG_KEYS[flag]: value for flag, value in (flags or {}).items()}
    cfg = _apply_overrides(cfg, overrides, example="client.lr=0.05", settings=settings)
    typed: ExperimentConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(typed)
    return typed


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
        key = item.split("=", 1)[0]
        if OmegaConf.select(cfg, key, default="__missing__") == "__missing__" and not _inside_params(key):
            raise ConfigError(f"bad override {item!r}: no config key '{key}' (see --print-config)")
    try:
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        for key, value in settings.items():
            if value is not None:
                OmegaConf.update(cfg, key, value, merge=True)
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(exc, "override") from None
    except ValueError as exc:  # e.g. from_dotlist on a malformed item
        raise ConfigError(f"bad override: {exc}") from None
    return cfg


#: Mappings whose keys the user chooses (their values are still typed or validated later).
OPEN_MAPPINGS = (".params.", ".engine.ray.client_resources.")


def _inside_params(key: str) -> bool:
    """Keys under a ``params`` mapping are validated later, by the component that owns them."""
    return any(m in f".{key}" for m in OPEN_MAPPINGS)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: ExperimentConfig) -> None:
    """Value checks that types alone cannot express."""
    _check(cfg.rounds >= 1, f"rounds must be >= 1, got {cfg.rounds}")
    _check(cfg.num_clients >= 1, f"num_clients must be >= 1, got {cfg.num_clients}")
    _check(cfg.seed >= 0, f"seed must be >= 0, got {cfg.seed}")
    _check(cfg.engine.name in ENGINES, f"engine must be one of {', '.join(ENGINES)}, got {cfg.engine.name!r}")
    _check(cfg.engine.threads_per_client >= 1, "engine.threads_per_client must be >= 1")
    _check(0.0 < cfg.strategy.fraction_train <= 1.0,
           f"strategy.fraction_train must be in (0, 1], got {cfg.strategy.fraction_train}")
    _check(0.0 <= cfg.strategy.fraction_evaluate <= 1.0,
           f"strategy.fraction_evaluate must be in [0, 1], got {cfg.strategy.fraction_evaluate}")
    _check(cfg.strategy.min_train_results >= 1,
           f"strategy.min_train_results must be >= 1, got {cfg.strategy.min_train_results}")
    _check(0.0 < cfg.data.test_fraction < 1.0, f"data.test_fraction must be in (0, 1), got {cfg.data.test_fraction}")
    _check(0.0 <= cfg.data.client_test_fraction < 1.0,
           f"data.client_test_fraction must be in [0, 1), got {cfg.data.client_test_fraction}")
    _check(cfg.data.partition.alpha > 0, f"data.partition.alpha must be > 0, got {cfg.data.partition.alpha}")
    _check(cfg.client.lr > 0, f"client.lr must be > 0, got {cfg.client.lr}")
    _check(cfg.client.batch_size >= 1, f"client.batch_size must be >= 1, got {cfg.client.batch_size}")
    _check(cfg.client.local_epochs >= 1, f"client.local_epochs must be >= 1, got {cfg.client.local_epochs}")
    _check(cfg.client.local_steps is None or cfg.client.local_steps >= 1,
           f"client.local_steps must be >= 1 when set, got {cfg.client.local_steps}")
    _check(cfg.client.optimizer in ("sgd", "adam"), f"client.optimizer must be 'sgd' or 'adam', got {cfg.client.optimizer!r}")
    _check(cfg.engine.flower.client_num_cpus > 0, "engine.flower.client_num_cpus must be > 0")
    validate_engine(cfg.engine)
    validate_privacy(cfg.privacy)


ENGINES = ("local", "ray", "flower")


def validate_engine(e: EngineConfig) -> None:
    _check(e.round_timeout_s > 0, f"engine.round_timeout_s must be > 0, got {e.round_timeout_s}")
    _check(e.client_timeout_s is None or e.client_timeout_s > 0,
           f"engine.client_timeout_s must be > 0 when set, got {e.client_timeout_s}")
    _check(e.retries >= 0, f"engine.retries must be >= 0, got {e.retries}")
    _check(e.vectorise in (True, False, "auto"),
           f"engine.vectorise must be true, false or auto, got {e.vectorise!r}")
    _check(e.vectorise_chunk >= 1, f"engine.vectorise_chunk must be >= 1, got {e.vectorise_chunk}")
    _check(e.ray.actor_num_cpus > 0, f"engine.ray.actor_num_cpus must be > 0, got {e.ray.actor_num_cpus}")
    _check(e.ray.actor_num_gpus >= 0, f"engine.ray.actor_num_gpus must be >= 0, got {e.ray.actor_num_gpus}")
    _check(e.ray.num_actors is None or e.ray.num_actors >= 1,
           f"engine.ray.num_actors must be >= 1 when set, got {e.ray.num_actors}")
    for pid, hint in e.ray.client_resources.items():
        _check(pid.isdigit(), f"engine.ray.client_resources: keys are partition ids, got {pid!r}")
        _check(hint.num_cpus > 0 and hint.num_gpus >= 0,
               f"engine.ray.client_resources.{pid}: num_cpus must be > 0 and num_gpus >= 0")
    s = e.system
    _check(s.seconds_per_step > 0, f"engine.system.seconds_per_step must be > 0, got {s.seconds_per_step}")
    _check(s.speed_sigma >= 0, f"engine.system.speed_sigma must be >= 0, got {s.speed_sigma}")
    _check(s.latency_s >= 0, f"engine.system.latency_s must be >= 0, got {s.latency_s}")
    _check(0 <= s.dropout < 1, f"engine.system.dropout must be in [0, 1), got {s.dropout}")
    _check(s.deadline_s is None or s.deadline_s > 0, f"engine.system.deadline_s must be > 0 when set, got {s.deadline_s}")
    f = e.faults
    _check(0 <= f.raise_fraction <= 1 and 0 <= f.hang_fraction <= 1 and f.raise_fraction + f.hang_fraction <= 1,
           "engine.faults.raise_fraction and hang_fraction must be in [0, 1] and sum to at most 1")
    _check(f.hang_s > 0, f"engine.faults.hang_s must be > 0, got {f.hang_s}")


def validate_privacy(p: PrivacyConfig) -> None:
    import math

    if not p.enabled:
        return
    _check(p.level in ("sample", "client"), f"privacy.level must be 'sample' or 'client', got {p.level!r}")
    _check(math.isfinite(p.update_clipping_norm) and p.update_clipping_norm > 0,
           f"privacy.update_clipping_norm must be > 0, got {p.update_clipping_norm}")
    _check(p.accountant in ("prv", "rdp"), f"privacy.accountant must be 'prv' or 'rdp', got {p.accountant!r}")
    _check(p.grad_sample_mode in ("hooks", "ew", "functorch", "ghost"),
           f"privacy.grad_sample_mode must be hooks, ew, functorch or ghost, got {p.grad_sample_mode!r}")
    _check((p.epsilon is None) != (p.noise_multiplier is None),
           "privacy: set exactly one of privacy.epsilon (--eps) and privacy.noise_multiplier")
    if p.epsilon is not None:
        _check(math.isfinite(p.epsilon) and p.epsilon > 0, f"--eps / privacy.epsilon must be a finite number > 0, got {p.epsilon}")
    if p.noise_multiplier is not None:
        _check(math.isfinite(p.noise_multiplier) and p.noise_multiplier > 0,
               f"privacy.noise_multiplier must be > 0, got {p.noise_multiplier}")
    _check(0 < p.delta < 1, f"privacy.delta must be in (0, 1), got {p.delta}")
    _check(math.isfinite(p.max_grad_norm) and p.max_grad_norm > 0, f"privacy.max_grad_norm must be > 0, got {p.max_grad_norm}")
    _check(p.max_physical_batch_size >= 1, "privacy.max_physical_batch_size must be >= 1")


def to_container(cfg: ExperimentConfig) -> dict[str, Any]:
    """Plain nested dict (picklable, YAML-able)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def to_yaml(cfg: ExperimentConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


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
