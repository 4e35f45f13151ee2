"""What to train: a model named by its import path, with its hyperparameters, checked up front.

A model is a ``LightningModule`` class named ``package.module:ClassName``, importable where the
flow and the Ray workers run. The dataset decides two of its keywords: ringflow passes
``input_dim`` (the number of feature columns) and, for classification, ``num_classes`` to a
constructor that declares them, so one class trains on data of any width
(docs/own-model.md).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ringflow.engine.errors import ModelError
from ringflow.engine.failures import one_line
from ringflow.storage.dataset import TableSchema

__all__ = [
    "DATA_HPARAMS",
    "ModelRef",
    "build_module",
    "check_json_hparams",
    "check_warm_start",
    "import_model",
    "model_hparams",
]

DATA_HPARAMS = ("input_dim", "num_classes")
"""Constructor keywords that the dataset fills in, when the constructor declares them."""

_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_HOOKS = ("training_step", "validation_step", "configure_optimizers")


@dataclass(frozen=True, kw_only=True)
class ModelRef:
    """A model by name: its import path and the keywords of its constructor."""

    path: str
    """``package.module:ClassName``."""
    hparams: dict[str, Any] = field(default_factory=dict)
    """Constructor keywords, JSON values only (they are recorded with every checkpoint)."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not _PATH.match(self.path):
            raise ModelError(
                f"model must be an import path 'package.module:ClassName', got {self.path!r}"
            )
        if not isinstance(self.hparams, dict):
            raise ModelError(f"hparams must be a JSON object, got {self.hparams!r}")
        check_json_hparams(self.hparams)

    def resolve(self) -> type[torch.nn.Module]:
        """The model class; see :func:`import_model`."""
        return import_model(self.path)

    @property
    def name(self) -> str:
        """The model's registry name: the class's ``model_name``, else its name in snake case."""
        declared = getattr(self.resolve(), "model_name", None)
        if isinstance(declared, str) and declared:
            return declared
        cls_name = self.path.rpartition(":")[2].rpartition(".")[2]
        return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", cls_name).lower()


def import_model(path: str) -> type[torch.nn.Module]:
    """Import the ``LightningModule`` class named ``package.module:ClassName``.

    Raises:
        ModelError: the module does not import, has no such class, or the class is not a
            module with ``training_step``, ``validation_step`` and ``configure_optimizers``.
    """
    module_name, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ModelError(
            f"model {path!r}: cannot import {module_name!r} ({err}); it must be importable "
            "where the flow and its Ray workers run (installed, or on PYTHONPATH)"
        ) from None
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"model {path!r}: {module_name} has no {qualname!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
        raise ModelError(f"model {path!r} is not a LightningModule class")
    missing = [hook for hook in _HOOKS if not callable(getattr(obj, hook, None))]
    if missing:
        raise ModelError(f"model {path!r} must define {', '.join(missing)}()")
    return obj


def check_json_hparams(hparams: dict[str, Any]) -> None:
    """Every hyperparameter is JSON: ringflow records them with every checkpoint and sends
    them to every worker, which builds its own module from them.

    Raises:
        ModelError: naming the first one that is not (a module, a ``functools.partial``...).
    """
    for name, value in hparams.items():
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError):
            raise ModelError(
                f"hparams {name!r} is a {type(value).__name__}, which is not JSON: pass "
                "numbers, strings, lists and dicts, and build the object from them in the "
                "module's __init__"
            ) from None


def model_hparams(
    module_cls: type, hparams: dict[str, Any], schema: TableSchema | None
) -> dict[str, Any]:
    """``hparams`` with what the data decides (:data:`DATA_HPARAMS` the constructor declares).

    Raises:
        ModelError: ``hparams`` sets one of them to another value than the data has, or one
            is not JSON (:func:`check_json_hparams`).
    """
    check_json_hparams(hparams)
    if schema is None:
        return dict(hparams)
    accepted = inspect.signature(module_cls).parameters
    derived = {"input_dim": schema.input_dim}
    if schema.task == "classification":
        derived["num_classes"] = schema.classes
    merged = dict(hparams)
    for name, value in derived.items():
        if name not in accepted:
            continue
        if name in hparams and hparams[name] != value:
            raise ModelError(
                f"hparams {name}={hparams[name]} does not match the data, which has {value}; "
                f"leave {name} out: ringflow sets it from the dataset"
            )
        merged[name] = value
    return merged


def check_warm_start(
    name: str, saved: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor], init_from: str
) -> None:
    """The warm-start model ``saved`` has the tensors, names and shapes of ``wanted`` (the
    module's state), the shapes of lazy parameters not yet materialised aside.

    Raises:
        ModelError: naming the tensors that are missing or shaped differently.
    """
    from torch.nn.parameter import is_lazy

    differ = sorted(
        key
        for key in set(saved) | set(wanted)
        if key not in saved
        or key not in wanted
        or (not is_lazy(wanted[key]) and saved[key].shape != wanted[key].shape)
    )
    if differ:
        raise ModelError(
            f"cannot warm-start {name} from {init_from}: tensors {differ[:5]} are missing or "
            "shaped differently (trained with other hparams?)"
        )


def build_module(module_cls: type, hparams: dict[str, Any]) -> torch.nn.Module:
    """``module_cls(**hparams)``, with a one-line error naming what the constructor refused.

    Raises:
        ModelError: the constructor does not take these keywords, or raised.
    """
    name = module_cls.__name__
    try:
        inspect.signature(module_cls).bind(**hparams)
    except TypeError as err:
        takes = ", ".join(
            p for p in inspect.signature(module_cls).parameters if p not in ("self", "args")
        )
        raise ModelError(
            f"{name} does not accept hparams {hparams}: {err} (it takes: {takes})"
        ) from None
    try:
        return module_cls(**hparams)
    except (TypeError, ValueError) as err:
        raise ModelError(f"{name}({_kwargs(hparams)}) refused its hparams: {err}") from None
    except Exception as err:  # the user's code: the same raises again on every attempt
        raise ModelError(
            f"{name}({_kwargs(hparams)}) raised {type(err).__name__}: {one_line(str(err))}"
        ) from err


def _kwargs(hparams: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in hparams.items())
