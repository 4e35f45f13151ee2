"""A house-price regressor: a user's own LightningModule, trained and served by ringflow.

    python -m ringflow.flows.train_pipeline --model houses:HousePrice \
        --data-url houses.csv --label price

ringflow passes ``input_dim`` (the number of feature columns in the CSV); everything else
here is this project's own choice.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F


class HousePrice(L.LightningModule):
    """A small perceptron from house features to a price (in thousands).

    The inputs are non-negative quantities of very different sizes (square metres, years,
    rooms, kilometres), so the model scales them itself: ``log1p`` brings each to about
    0..6. The output is scaled the other way (``price_scale``), so the served model takes
    and answers the raw numbers of the CSV.

    Args:
        input_dim: feature columns (set by ringflow from the data).
        hidden: width of the two hidden layers.
        lr: Adam learning rate.
        price_scale: the order of magnitude of a price; the network predicts price / scale.
    """

    model_name = "house-price"
    """The registry name (otherwise it would be the class name in snake case)."""
    data_defaults = {
        "bounds": {
            "size_m2": [5, 5000],
            "age_years": [0, 500],
            "rooms": [1, 100],
            "distance_km": [0, 1000],
        },
    }
    """Rows outside these ranges are rejected at preprocessing and refused (HTTP 400) when
    served; the flow's ``--bounds`` overrides them."""
    search_space = {"lr": {"loguniform": [0.003, 0.05]}, "hidden": [32, 64]}
    """What ``--tune-trials`` explores unless ``--tune-space`` says otherwise."""

    def __init__(
        self,
        *,
        input_dim: int,
        hidden: int = 64,
        lr: float = 0.01,
        price_scale: float = 100.0,
    ) -> None:
        super().__init__()
        if input_dim < 1 or hidden < 1:
            raise ValueError("input_dim and hidden must be at least 1")
        if lr <= 0 or price_scale <= 0:
            raise ValueError("lr and price_scale must be positive")
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Features ``[n, input_dim]`` to prices ``[n]``."""
        return self.net(torch.log1p(x.clamp(min=0))).squeeze(-1) * self.hparams.price_scale

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        # The loss in scaled units keeps its gradients near 1 whatever the currency.
        loss = F.mse_loss(self(x) / self.hparams.price_scale, y / self.hparams.price_scale)
        self.log("train_loss", loss)
        return loss

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str) -> None:
        x, y = batch
        predicted = self(x)
        scale = self.hparams.price_scale
        self.log(f"{prefix}_loss", F.mse_loss(predicted / scale, y / scale))
        self.log(f"{prefix}_mae", (predicted - y).abs().mean())

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
