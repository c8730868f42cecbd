"""Keep third-party chatter (Flower, Ray, MLflow) out of the console unless asked for."""

from __future__ import annotations

import logging
import os
import warnings

QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "RAY_AIR_NEW_OUTPUT": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}

NOISY_LOGGERS = ("flwr", "ray", "mlflow", "alembic")


def quiet_third_party(verbose: bool = False) -> None:
    """Set the quiet environment and logger levels; call after the libraries are imported."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if verbose:
        return
    import flwr.common.logger  # noqa: F401  (import first: it configures its logger on import)

    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
