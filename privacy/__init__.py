"""Differential privacy (Opacus DP-SGD, noise calibration, per-client ledger)."""
