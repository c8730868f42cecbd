"""Differential privacy: Opacus DP-SGD inside client learners, noise calibration, a per-client ledger."""
