"""The second demo: a small character-level transformer language model on Python's own source.

The text is the standard library's top-level ``.py`` files (``os.path.dirname(os.__file__)``),
present on every machine with Python, so nothing is downloaded. Files are taken in sorted
name order, bytes are mapped to 7-bit characters (anything else becomes ``?``), and the text
is cut into non-overlapping windows of ``context + 1`` characters: the model reads the first
``context`` and predicts each next one.

:func:`write_charlm_parquet` writes the windows as a Parquet drop, one ``int`` column per
position (``c0`` .. ``c{context}``) plus ``label`` (the window's last character, so the
stratified split of ``storage.dataset.preprocess`` has a class to stratify by); ``preprocess``
then validates, splits (deterministically, by seed) and shards it like any dataset, and the
engine reads it back as ``(features, labels)``. ``CharLM.pipeline_batch`` turns the features
into the input ids and the next-character targets.

``CharLM`` exposes its layers in order for pipeline parallelism (``pipeline_layers()``):
the embedding, the transformer blocks, then the final norm and head.
"""

from __future__ import annotations

import os

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn
from torch.nn import functional as F

from ringflow.storage.dataset import Column, TableSchema
from ringflow.storage.fs import atomic_write, exists, join

__all__ = ["VOCAB", "CharLM", "charlm_schema", "stdlib_text", "write_charlm_parquet"]

VOCAB = 128
"""7-bit characters."""


def charlm_schema(context: int) -> TableSchema:
    """Columns of a window of ``context + 1`` character codes, and the stratification label."""
    return TableSchema(
        features=tuple(
            Column(name=f"c{i}", dtype="int", min=0, max=VOCAB - 1) for i in range(context + 1)
        ),
        label=Column(name="label", dtype="int", min=0, max=VOCAB - 1),
    )


def stdlib_text(*, max_chars: int = 400_000, root: str | None = None) -> str:
    """The first ``max_chars`` characters of the standard library's top-level ``.py`` files,
    in sorted file-name order (deterministic for a given Python version)."""
    root = root or os.path.dirname(os.__file__)
    parts, total = [], 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(root, name), "rb") as f:
            text = f.read().decode("ascii", errors="replace").replace("\ufffd", "?")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def write_charlm_parquet(url: str, *, context: int = 64, max_chars: int = 400_000) -> int:
    """Write the standard library text as windows of ``context + 1`` characters to ``url``.

    Returns:
        The number of windows (rows).
    """
    codes = np.frombuffer(stdlib_text(max_chars=max_chars).encode("ascii"), dtype=np.uint8)
    width = context + 1
    windows = codes[: len(codes) // width * width].reshape(-1, width).astype(np.int64)
    columns = {f"c{i}": windows[:, i] for i in range(width)}
    columns["label"] = windows[:, -1]
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink)
    atomic_write(url, sink.getvalue().to_pybytes())
    return len(windows)


class _Embedding(nn.Module):
    def __init__(self, context: int, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(context, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class _Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        # No bias: a key bias has no gradient (softmax ignores it), and Adam would turn its
        # rounding noise into steps of full size.
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class _Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class CharLM(L.LightningModule):
    """A character-level transformer LM.

    Args:
        context: characters the model reads (the dataset's windows hold ``context + 1``).
        width: embedding width.
        depth: transformer blocks.
        heads: attention heads (divide ``width``).
        dropout: dropout in attention and MLP.
        lr: AdamW learning rate.
    """

    def __init__(
        self,
        *,
        context: int = 64,
        width: int = 64,
        depth: int = 4,
        heads: int = 4,
        dropout: float = 0.0,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width ({width}) must be a multiple of heads ({heads})")
        if min(context, width, depth, heads) < 1:
            raise ValueError("context, width, depth and heads must be at least 1")
        self.save_hyperparameters()
        self.embed = _Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads, dropout) for _ in range(depth))
        self.head = _Head(width)

    @staticmethod
    def example_data(directory_url: str, hparams: dict) -> str:
        """The standard library's text as windows of ``context + 1`` characters, a Parquet
        file in ``directory_url`` (written once); its URL."""
        context = int(hparams.get("context", 64))
        url = join(directory_url, f"charlm-stdlib-c{context}.parquet")
        if not exists(url):
            write_charlm_parquet(url, context=context)
        return url

    def pipeline_layers(self) -> list[nn.Module]:
        """Forward order: embedding, each block, final norm and head."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    @staticmethod
    def pipeline_batch(
        features: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows of ``context + 1`` codes (float from the dataset) into ids and targets."""
        del labels  # only there for the stratified split
        codes = features.long()
        return codes[:, :-1], codes[:, 1:]

    @staticmethod
    def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-character cross-entropy (nats per character)."""
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, targets = self.pipeline_batch(*batch)
        return self.pipeline_loss(self(ids), targets)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: torch.Tensor, batch_idx: int = 0) -> dict[str, torch.Tensor]:
        """The character that follows each window (its last ``context`` codes are read)."""
        ids = batch.long()[:, -self.hparams.context :]
        probabilities = self(ids)[:, -1].softmax(dim=-1)
        return {
            "next": probabilities.argmax(dim=-1),
            "probability": probabilities.max(dim=-1).values,
        }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
