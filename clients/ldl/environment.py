"""What an LDL run trains on: the data set, its split, each node's rows and tensors, the augmentation and
the network, built once on first use from ``client.params`` (:class:`clients.ldl_learner.LDLParams`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from clients.ldl.augment import Augment, augment_for
from clients.supervised import make_dp_compatible
from envs.ldl import LDLData, LDLSplit, NodeRows, federated_ldl, image_ldl, split_ldl, tabular_ldl
from fedsim.config import ExperimentConfig
from fedsim.errors import ConfigError
from fedsim.models import build_model
from fedsim.seeding import derive_seed

if TYPE_CHECKING:
    from clients.ldl_learner import LDLParams

__all__ = ["DATASETS", "LDLEnvironment", "NodeData"]

DATASETS = ("a", "b")  # a: image LDL (digits / MNIST), b: synthetic tabular LDL


@dataclass
class NodeData:
    """A node's tensors: labelled rows with their distributions, unlabelled rows (and their truth, to measure)."""

    x_l: torch.Tensor
    d_l: torch.Tensor
    x_u: torch.Tensor
    d_u: torch.Tensor  # never used in training


class LDLEnvironment:
    """The run's data, split, node rows and tensors, augmentation and network, each built lazily and cached."""

    def __init__(self, cfg: ExperimentConfig, params: LDLParams) -> None:
        self.cfg, self.params = cfg, params
        self._data: LDLData | None = None
        self._split: LDLSplit | None = None
        self._rows: list[NodeRows] | None = None
        self._nodes: dict[int, NodeData] = {}
        self._model: nn.Module | None = None
        self._augment: Augment | None = None

    @property
    def sample_level_dp(self) -> bool:
        """Whether the run trains with sample-level DP-SGD."""
        return self.cfg.privacy.enabled and self.cfg.privacy.level == "sample"

    @property
    def data(self) -> LDLData:
        """The data set: image LDL (``a``) or synthetic tabular LDL (``b``)."""
        if self._data is None:
            p, seed = self.params, self.cfg.seed
            self._data = (image_ldl(p.image, seed, "client.params.image") if p.dataset == "a"
                          else tabular_ldl(p.tabular, seed, "client.params.tabular"))
        return self._data

    @property
    def split(self) -> LDLSplit:
        """Labelled / unlabelled / test (/ validation) rows of the data set."""
        if self._split is None:
            p = self.params
            try:
                self._split = split_ldl(self.data, p.labelled_ratio, p.test_fraction, derive_seed(self.cfg.seed, "ldl"),
                                        self.cfg.evaluation.validation_fraction)
            except ConfigError as exc:
                raise ConfigError(f"client.params: {exc}") from None
        return self._split

    @property
    def rows(self) -> list[NodeRows]:
        """Each node's labelled and unlabelled rows (:func:`envs.ldl.federated_ldl`)."""
        if self._rows is None:
            p = self.params
            n_u, k = len(self.split.unlabelled), self.cfg.num_clients
            if k > 1 and p.min_unlabelled * k > n_u:
                raise ConfigError(f"client.params.min_unlabelled={p.min_unlabelled} x {k} clients exceeds the "
                                  f"{n_u} unlabelled rows; lower it or num_clients")
            try:
                self._rows = federated_ldl(self.data, self.split, k, p.labelled_clients, p.alpha, p.min_unlabelled,
                                           derive_seed(self.cfg.seed, "ldl-clients"))
            except ConfigError as exc:
                raise ConfigError(f"client.params (labelled_clients / alpha / min_unlabelled): {exc}") from None
        return self._rows

    def node(self, partition_id: int) -> NodeData:
        """The node's rows as tensors."""
        if partition_id not in self._nodes:
            r, x, d = self.rows[partition_id], self.data.x, self.data.d
            t = torch.from_numpy
            self._nodes[partition_id] = NodeData(t(x[r.labelled]), t(d[r.labelled]), t(x[r.unlabelled]),
                                                 t(d[r.unlabelled]))
        return self._nodes[partition_id]

    @property
    def augment(self) -> Augment:
        """Augmentation scaled by the training pool's statistics; under DP by the server's test split's
        (the pool's std would be a statistic of every node's private rows, outside the ledger)."""
        if self._augment is None:
            rows = (self.split.test if self.sample_level_dp
                    else np.concatenate([self.split.labelled, self.split.unlabelled]))
            self._augment = augment_for(self.data.x[rows], self.params.augment)
        return self._augment

    def build_network(self) -> nn.Module:
        """A fresh network: ``client.params.model`` (auto: cnn for images, mlp for tabular), GroupNorm under DP."""
        p, data = self.params, self.data
        name = p.model if p.model != "auto" else ("cnn" if len(data.input_shape) == 3 else "mlp")
        model = build_model(name, dict(p.model_params), data.input_shape, data.num_labels)
        return make_dp_compatible(model) if self.sample_level_dp else model  # BatchNorm -> GroupNorm

    @property
    def model(self) -> nn.Module:
        """The network the learner loads each round's arrays into (built once)."""
        if self._model is None:
            self._model = self.build_network()
        return self._model
