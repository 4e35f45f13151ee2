"""Which of three cultivars a wine comes from, from its chemistry (scikit-learn's wine data).

ringflow fills ``input_dim`` and ``num_classes`` from the dataset, so the same class takes
the 13 measured columns plus whatever ``tasks.features`` adds.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F


class WineClassifier(L.LightningModule):
    """A one-hidden-layer perceptron over log-scaled measurements.

    Args:
        input_dim: feature columns (set by ringflow from the data).
        num_classes: cultivars (set by ringflow from the data).
        hidden: width of the hidden layer.
        lr: Adam learning rate.
    """

    model_name = "wine"
    data_defaults = {"label": "cultivar"}
    """The flow's ``label`` when none is given."""

    def __init__(
        self, *, input_dim: int, num_classes: int, hidden: int = 32, lr: float = 0.02
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Measurements run from about 0.1 (phenols) to 1,680 (proline): log1p evens them out.
        return self.net(torch.log1p(x.clamp(min=0)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{prefix}_loss", F.cross_entropy(logits, y))
        self.log(f"{prefix}_accuracy", (logits.argmax(dim=1) == y).float().mean())

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
