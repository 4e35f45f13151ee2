"""The demo: scikit-learn's bundled handwritten digits (8x8 images, 1,797 samples).

The model takes raw pixel intensities (0 to 16, as in the data set) and scales them itself,
so the served model answers the same numbers a user would send.
"""

from __future__ import annotations

import csv
import io

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

from ringflow.storage.dataset import Column, TableSchema
from ringflow.storage.fs import atomic_write, exists, join

__all__ = ["SCHEMA", "DigitsClassifier", "write_digits_csv"]

PIXELS = 64
CLASSES = 10

SCHEMA = TableSchema(
    features=tuple(Column(name=f"p{i}", dtype="float", min=0.0, max=16.0) for i in range(PIXELS)),
    label=Column(name="label", dtype="int", min=0, max=CLASSES - 1),
)
"""Columns of the raw CSV drop: ``p0`` .. ``p63`` (pixel intensity 0-16) and ``label`` (0-9)."""


class DigitsClassifier(L.LightningModule):
    """A two-layer perceptron over the 64 pixels of a digit.

    Args:
        hidden: width of the hidden layer.
        lr: Adam learning rate.
        input_dim: pixels per image (given by ringflow from the dataset).
        num_classes: digits (given by ringflow from the dataset).
    """

    model_name = "digits"
    """The registry name."""
    input_schema = {"name": "pixels", "shape": [PIXELS], "min": 0.0, "max": 16.0}
    """Served requests send ``{"pixels": [64 numbers]}``."""
    output_name = "digit"
    data_defaults = {
        "bounds": {c.name: [c.min, c.max] for c in SCHEMA.features},
        "classes": CLASSES,
    }
    """What a digits file holds: intensities 0-16 and labels 0-9; other rows are rejected."""
    search_space = {"lr": {"loguniform": [0.001, 0.1]}, "hidden": [64, 128, 256]}
    """What tuning explores unless told otherwise."""

    def __init__(
        self,
        *,
        hidden: int = 128,
        lr: float = 0.01,
        input_dim: int = PIXELS,
        num_classes: int = CLASSES,
    ) -> None:
        super().__init__()
        if hidden < 1:
            raise ValueError(f"hidden must be at least 1, got {hidden}")
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        self.save_hyperparameters()
        self.scale = _Scale(1 / 16.0)
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    @staticmethod
    def example_data(directory_url: str, hparams: dict) -> str:
        """The bundled digits as a CSV in ``directory_url`` (written once); its URL."""
        del hparams  # the same data for every configuration
        url = join(directory_url, "digits.csv")
        if not exists(url):
            write_digits_csv(url)
        return url

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.net(self.scale(pixels))

    def pipeline_layers(self) -> list[nn.Module]:
        """Forward order, for pipeline stages (docs/pipeline.md)."""
        return [self.scale, *self.net]

    @staticmethod
    def pipeline_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels)

    @staticmethod
    def pipeline_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"accuracy": (logits.argmax(dim=1) == labels).float().mean()}

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
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


class _Scale(nn.Module):
    """Pixel intensities (0-16) to 0-1; a layer of its own so pipeline stages can hold it."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def write_digits_csv(url: str) -> int:
    """Write the bundled digits as a raw CSV drop at ``url``; return the number of rows."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow([c.name for c in SCHEMA.features] + [SCHEMA.label.name])
    for image, label in zip(digits.data, digits.target, strict=True):
        writer.writerow([int(v) for v in image] + [int(label)])
    atomic_write(url, buf.getvalue().encode())
    return len(digits.target)
