"""Class-imbalanced graph domain adaptation (ImGDA, NeurIPS 2025) on torch-geometric: operators, model,
losses, baselines and metrics used by :mod:`clients.graph_learner`."""
