"""Numerical kernels for the server side of federated strategies."""

from fedsim.kernels.lowrank_svd import (
    orthonormal_rows_mask,
    refactor_lora_state_dict,
    svd_refactor,
    svd_refactor_reference,
)

__all__ = [
    "orthonormal_rows_mask",
    "refactor_lora_state_dict",
    "svd_refactor",
    "svd_refactor_reference",
]
