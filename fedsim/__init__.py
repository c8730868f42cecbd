"""fedsim: federated and continual learning simulation on Flower, Ray, Opacus and MLflow.

``fedsim.run(experiment, ...)`` runs an experiment from Python (see :mod:`fedsim.api`); the
``fedsim`` command does the same from a shell.
"""

from fedsim.api import curve, experiment_config, final, run  # noqa: F401
