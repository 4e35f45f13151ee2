"""A GPT-2-style decoder (nanoGPT's shape) as a LightningModule, and its offline corpus.

The model: token and position embeddings, pre-LayerNorm blocks of causal self-attention
(``F.scaled_dot_product_attention``, which picks flash attention on GPUs) and a GELU MLP, a
final LayerNorm and an LM head tied to the token embedding. The head is computed with the
embedding's weight (``F.linear``) rather than a second module sharing it, so the state dict
holds the weight once (safetensors refuses tensors that share memory).

``GPTConfig.preset("gpt2_small")`` is GPT-2 small (12 layers, 12 heads, 768 wide, 1,024
tokens of context, about 124 M parameters); ``"tiny"`` is for tests on CPU.

The corpus needs no download: :func:`stdlib_tokens` reads every ``.py`` file of the running
Python's standard library (``sysconfig.get_paths()["stdlib"]``, without ``site-packages`` or
``dist-packages``), sorted by path relative to that folder, and concatenates their bytes; the
tokens are those UTF-8 bytes (ids 0-255). It is the same on every machine with the same
Python version. The presets' vocabularies are larger than 256 only so that their size and
FLOPs match GPT-2's; ids above 255 never occur. :class:`TokenWindows` cuts the tokens into
non-overlapping windows: sample ``i`` is ``(tokens[i*T : i*T+T], tokens[i*T+1 : i*T+T+1])``.

``GPTModule(compile=True)`` compiles each transformer block on its own in ``configure_model``
(as torchtitan does): the gradients of a block are ready, and their buckets can start their
all-reduces, as soon as that block's backward has run, not after the whole model's.
``compile="model"`` compiles the whole model at once, as most users write it
(``torch.compile(model)``); the engine's workers then split its graph at the gradient
buckets (``engine.module.compiled_in_buckets``), so its backward overlaps too.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sysconfig
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

__all__ = [
    "PRESETS",
    "GPT",
    "GPTConfig",
    "GPTModule",
    "TokenWindows",
    "stdlib_tokens",
    "warmup_cosine",
]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The shape of a GPT; validated on construction."""

    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int
    """Width of the residual stream."""
    block_size: int
    """Longest sequence (context) the position embedding covers."""
    vocab_size: int
    """Token ids the embedding and head cover (the byte corpus uses 0-255)."""
    dropout: float = 0.0
    """Dropout after attention, MLP and embeddings (0 for pre-training speed runs)."""
    bias: bool = True
    """Biases in the linear layers and LayerNorms, as GPT-2 has. The key projection's bias
    gets no gradient but rounding noise (softmax ignores what it adds to a query's scores
    alike), which Adam scales up to steps of the learning rate's size: results then differ
    beyond 1e-5 between worker counts. ``False`` avoids it (nanoGPT's option)."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_head ({self.n_head}) must divide n_embd ({self.n_embd})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """The preset ``name`` (:data:`PRESETS`) with ``overrides`` of its fields.

        Raises:
            ValueError: an unknown preset or field.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; the presets are {sorted(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {unknown}; the fields are {sorted(fields)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS: dict[str, GPTConfig] = {
    "gpt2_small": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=256, bias=False),
}
"""``gpt2_small``: GPT-2 small (124 M parameters; the vocabulary rounded up to a multiple of
64, as nanoGPT does). ``tiny``: 2 layers, 64 wide, without biases, for tests on CPU."""


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(batch, time, width))


class Block(nn.Module):
    """Pre-LayerNorm: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias),
        )
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """The decoder: ``forward(ids)`` gives next-token logits for every position."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream.
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        time = ids.shape[1]
        if time > self.config.block_size:
            raise ValueError(
                f"sequences of {time} tokens exceed GPTConfig.block_size "
                f"({self.config.block_size}); cut them shorter or raise block_size"
            )
        positions = torch.arange(time, device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # the head tied to the embedding

    def num_params(self, *, embeddings: bool = False) -> int:
        """Parameters; without ``embeddings``, less the position embedding (nanoGPT's count,
        which the token embedding stays in because the head uses it)."""
        total = sum(p.numel() for p in self.parameters())
        return total if embeddings else total - self.wpe.weight.numel()

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward and backward) as PaLM's appendix B and nanoGPT's
        MFU count them: ``6 N`` for the weights plus ``12 L H Q T`` for attention (``Q`` the
        head width, ``T`` the sequence length, ``block_size`` unless given)."""
        c = self.config
        seq_len = seq_len or c.block_size
        return 6 * self.num_params() + 12 * c.n_layer * c.n_embd * seq_len


def warmup_cosine(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """The learning-rate factor at optimizer ``step``: linear warm-up over ``warmup`` steps,
    then a cosine from 1 down to ``min_ratio`` at ``total`` steps (and ``min_ratio`` after)."""
    if step < warmup:
        return (step + 1) / warmup
    if step >= total:
        return min_ratio
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))


class GPTModule(L.LightningModule):
    """A GPT trained on next-token prediction; every argument is JSON.

    Args:
        preset: a :data:`PRESETS` name.
        overrides: fields of :class:`GPTConfig` to change in the preset.
        lr: the peak learning rate of AdamW.
        weight_decay: applied to matrices and embeddings, not to biases and LayerNorms.
        warmup_steps: optimizer steps of linear warm-up.
        decay_steps: optimizer steps of the cosine decay's end; ``None`` for the run's
            (``trainer.estimated_stepping_batches``).
        min_lr_ratio: the learning rate at the end of the decay, as a share of ``lr``.
        compile: ``torch.compile`` in ``configure_model``: ``True`` (or ``"blocks"``) each
            transformer block, ``"model"`` the whole model at once.
        compile_backend: the backend for ``compile`` (``"inductor"``; ``"aot_eager"`` compiles
            quickly for tests).
    """

    def __init__(
        self,
        preset: str = "tiny",
        overrides: dict[str, Any] | None = None,
        *,
        lr: float = 6e-4,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        decay_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        compile: bool | str = False,  # noqa: A002 - the hparam's name
        compile_backend: str = "inductor",
    ) -> None:
        super().__init__()
        if compile not in (False, True, "blocks", "model"):
            raise ValueError(
                f'GPTModule compile must be False, True, "blocks" or "model"; got {compile!r}'
            )
        if lr <= 0 or weight_decay < 0 or warmup_steps < 0 or not 0 <= min_lr_ratio <= 1:
            raise ValueError(
                f"GPTModule needs lr > 0, weight_decay >= 0, warmup_steps >= 0 and "
                f"min_lr_ratio in [0, 1]; got lr={lr}, weight_decay={weight_decay}, "
                f"warmup_steps={warmup_steps}, min_lr_ratio={min_lr_ratio}"
            )
        self.save_hyperparameters()
        self.config = GPTConfig.preset(preset, **(overrides or {}))
        self.model = GPT(self.config)

    def configure_model(self) -> None:
        """With ``compile``: compile each block on its own (its backward is one graph, after
        which its parameters' gradient hooks fire), leaving embeddings and head eager; with
        ``compile="model"``, the whole model."""
        if not self.hparams.compile:
            return
        if self.hparams.compile == "model":
            if not hasattr(self.model, "_orig_mod"):  # not compiled yet
                self.model = torch.compile(self.model, backend=self.hparams.compile_backend)
            return
        blocks = self.model.blocks
        for i, block in enumerate(blocks):
            if not hasattr(block, "_orig_mod"):  # not compiled yet
                blocks[i] = torch.compile(block, backend=self.hparams.compile_backend)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy of the next token over every position of the batch."""
        ids, targets = batch
        logits = self.model(ids)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (:meth:`GPT.flops_per_token`), for MFU."""
        return self.model.flops_per_token(seq_len)

    def configure_optimizers(self) -> dict[str, Any]:
        h = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": h.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = params[0].is_cuda  # one kernel for the whole step on GPUs
        optimizer = torch.optim.AdamW(groups, lr=h.lr, betas=(0.9, 0.95), fused=fused)
        total = h.decay_steps or int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(
                step, warmup=h.warmup_steps, total=total, min_ratio=h.min_lr_ratio
            ),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class TokenWindows(Dataset):
    """Non-overlapping windows of ``block_size`` tokens and their next tokens.

    Sample ``i`` is ``(tokens[i*T : i*T+T], tokens[i*T+1 : i*T+T+1])`` as int64, ``T`` the
    block size; the tokens are kept as bytes (``uint8``), a quarter of int32's memory.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if tokens.dim() != 1 or len(tokens) < block_size + 1:
            raise ValueError(
                f"TokenWindows needs a 1-D tensor of at least block_size + 1 = {block_size + 1} "
                f"tokens, got shape {tuple(tokens.shape)}"
            )
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


def stdlib_tokens(*, max_tokens: int | None = None, root: str | None = None) -> torch.Tensor:
    """The bytes of the standard library's ``.py`` files as a ``uint8`` tensor of token ids.

    Files are every ``*.py`` under ``root`` (the running Python's
    ``sysconfig.get_paths()["stdlib"]``), ``site-packages`` and ``dist-packages`` left out,
    sorted by path relative to ``root``; reading stops once ``max_tokens`` bytes are taken.

    Raises:
        ValueError: ``root`` holds no ``.py`` file.
    """
    root = root or sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for path in _python_files(root):
        with open(os.path.join(root, path), "rb") as f:
            chunks.append(f.read())
        total += len(chunks[-1])
        if max_tokens is not None and total >= max_tokens:
            break
    if not chunks:
        raise ValueError(f"no .py files under {root}; pass root= a folder of Python sources")
    data = bytearray(b"".join(chunks)[:max_tokens])
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _python_files(root: str) -> list[str]:
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        relative = os.path.relpath(folder, root)
        files.extend(
            os.path.normpath(os.path.join(relative, n)) for n in names if n.endswith(".py")
        )
    return sorted(files)
