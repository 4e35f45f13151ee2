"""A multilayer perceptron for any table: classification or regression, any number of columns.

Its width comes from the data: ringflow passes ``input_dim`` (the number of feature columns)
and, for a classification dataset, ``num_classes``, to every constructor that accepts them.
Without ``num_classes`` the model is a regressor (one output, mean squared error).

    python -m ringflow.flows.train_pipeline --model ringflow.models.tabular:TabularMLP \\
        --data-url houses.csv --label price
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["TabularMLP"]


class TabularMLP(L.LightningModule):
    """``depth`` hidden layers of ``hidden`` units and one head (a class score each, or a value).

    Args:
        input_dim: feature columns (given by ringflow from the dataset).
        num_classes: classes of a classification dataset; ``None`` makes a regressor.
        hidden: width of each hidden layer.
        depth: hidden layers.
        lr: Adam learning rate.
    """

    def __init__(
        self,
        *,
        input_dim: int,
        num_classes: int | None = None,
        hidden: int = 64,
        depth: int = 2,
        lr: float = 0.01,
    ) -> None:
        super().__init__()
        if min(input_dim, hidden, depth) < 1:
            raise ValueError("input_dim, hidden and depth must be at least 1")
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = input_dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes or 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out if self.hparams.num_classes else out.squeeze(-1)

    def pipeline_layers(self) -> list[nn.Module]:
        """Forward order, for pipeline stages."""
        return list(self.net)

    def pipeline_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.hparams.num_classes:
            return F.cross_entropy(out, target)
        return F.mse_loss(out.squeeze(-1), target)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str) -> None:
        x, y = batch
        out = self(x)
        self.log(f"{prefix}_loss", self.pipeline_loss(out, y))
        if self.hparams.num_classes:
            self.log(f"{prefix}_accuracy", (out.argmax(dim=1) == y).float().mean())
        else:
            self.log(f"{prefix}_mae", (out - y).abs().mean())

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
