"""A flow's parameters, typed and checked once at the edge, then handed to the tasks as such.

:class:`RunSpec` turns ``train-pipeline``'s parameters into the engine's own objects
(``ModelRef``, ``PipelineConfig``; ``training`` already is a ``TrainConfig``, handed down as
it came) before anything runs, so a bad
combination fails the run at once. It needs the engine but not Prefect or Ray: the command
line builds one to check its options before either starts.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from ringflow.engine import TrainConfig
from ringflow.engine.errors import ModelError
from ringflow.engine.hooks import overrides
from ringflow.engine.pipeline import PipelineConfig
from ringflow.engine.pipeline.checks import check_micro_batches
from ringflow.engine.spec import ModelRef
from ringflow.engine.trainer import check_layout
from ringflow.flows.preflight import check_data_file
from ringflow.storage.fs import absolute
from ringflow.storage.layout import TRIAL_MARK, Workspace

__all__ = ["RunSpec"]

_DATA = ("label", "features", "task", "bounds", "classes", "categorical")
"""Parameters describing the data; a model's ``data_defaults`` gives defaults for them."""


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything one run of ``train-pipeline`` does, decided before it starts."""

    model: ModelRef
    model_name: str
    data_url: str | None
    own_data: bool
    """The model makes its own data (its ``train_dataloader()``; no ``data_url``): no
    preprocessing, training with ``data=None``, evaluation on its own loaders."""
    data: dict[str, Any]
    """Keywords of the ``preprocess`` task: label, features, task, bounds, classes..."""
    workspace: Workspace
    run_key: str
    config: TrainConfig
    pipeline: PipelineConfig | None
    tune: dict[str, Any] | None
    """Keywords of the ``tune`` task, or ``None`` without a search."""
    use_best_checkpoint: bool
    warm_start: bool
    tolerance: float
    allowed_models: tuple[str, ...]
    """Model classes the gate and the server may load from the registry: ``model`` first."""
    serve: bool
    serve_port: int
    loggers: tuple[str, ...] = ()
    """Lightning loggers by name (``tasks.train.run_loggers``)."""
    preprocess_engine: str = "auto"
    """Where preprocessing runs (``storage.dataset.ENGINES``)."""

    @property
    def storage_url(self) -> str:
        return self.workspace.url

    @classmethod
    def build(cls, **p: Any) -> RunSpec:
        """Check the parameters together and build the run's typed parts.

        Raises:
            ModelError: the model does not import or does not take an ``hparams`` key.
            ValueError: a combination no single parameter's bounds can refuse.
        """
        if p["use_best_checkpoint"] and not p["tune_trials"]:
            raise ValueError(
                "use_best_checkpoint takes the best tuning trial's model, but tune_trials is 0: "
                "set tune_trials to 1 or more, or leave use_best_checkpoint off"
            )
        if TRIAL_MARK in (p["run_key"] or ""):
            raise ValueError(
                f"run_key {p['run_key']!r} contains {TRIAL_MARK!r}, which names the checkpoints of "
                "a run's tuning trials; choose a key without it"
            )
        config = p["training"]
        if not isinstance(config, TrainConfig):  # the JSON object a caller gave
            config = TrainConfig(**(config or {}))
        pipeline = None
        if p["pipeline_stages"] > 1:
            pipeline = PipelineConfig(
                stages=p["pipeline_stages"],
                micro_batches=p["micro_batches"],
                schedule=p["pipeline_schedule"],
            )
            check_micro_batches(config, pipeline)
        check_layout(
            config, pipeline, init_from="the production model" if p["warm_start"] else None
        )
        # Last: importing the model (and Lightning) takes longest.
        model = ModelRef(path=p["model"], hparams=dict(p["hparams"] or {}))
        _check_keywords(model)
        own_data = not p["data_url"] and overrides(model.resolve(), "train_dataloader")
        if own_data:
            _check_own_data(model, p)
        return cls(
            model=model,
            model_name=p["model_name"] or model.name,
            data_url=absolute(p["data_url"]) if p["data_url"] else None,
            own_data=own_data,
            data=_data_parameters(model, p),
            workspace=Workspace(p["storage_url"]),
            run_key=p["run_key"] or "local",
            config=config,
            pipeline=pipeline,
            tune=_tune_parameters(config, p),
            use_best_checkpoint=p["use_best_checkpoint"],
            warm_start=p["warm_start"],
            tolerance=p["promotion_tolerance"],
            allowed_models=_allowed_models(model, p["allowed_models"]),
            serve=p["serve"],
            serve_port=p["serve_port"],
            loggers=_loggers(p["loggers"]),
            preprocess_engine=p["preprocess_engine"],
        )

    def check_data(self) -> None:
        """Check, before any work, that the data file is there and names the columns used.

        Raises:
            PreflightError: the file is missing, unreadable, or lacks the label or a feature.
        """
        if self.data_url:
            check_data_file(self.data_url, label=self.data["label"], features=self.data["features"])

    def tuned(self, best: dict[str, Any]) -> tuple[ModelRef, TrainConfig]:
        """The model and configuration the search chose: exactly what training then uses."""
        model = ModelRef(path=self.model.path, hparams=best["best_hparams"])
        config = self.config.with_changes(**best["best_train"])
        if self.pipeline is not None:
            check_micro_batches(config, self.pipeline)
        check_layout(config, self.pipeline)
        return model, config


def _check_keywords(model: ModelRef) -> None:
    """Every ``hparams`` key is a keyword of the model's constructor."""
    params = inspect.signature(model.resolve()).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(model.hparams) - set(params))
    if unknown:
        raise ModelError(
            f"hparams {unknown} are not keywords of {model.path}; it takes {sorted(params)}"
        )


_NOT_FOR_OWN_DATA = {
    **dict.fromkeys(_DATA, "it describes a data file's columns"),
    "preprocess_engine": "nothing is preprocessed",
    "tune_trials": "the search trains its trials on a data file: set it to 0",
    "pipeline_stages": "pipeline stages train on tables: leave it at 1",
    "serve": "a served model reads requests by a data file's columns: pass --no-serve",
}
"""What a run of a model that makes its own data refuses where it is given, and why."""
_UNSET = {"task": "auto", "preprocess_engine": "auto", "pipeline_stages": 1}


def _check_own_data(model: ModelRef, p: dict[str, Any]) -> None:
    """Refuse, in one line, what does not apply to a model that makes its own data.

    Raises:
        ValueError: naming each such parameter and why.
    """
    given = [
        f"{name}={p[name]!r} ({why})"
        for name, why in _NOT_FOR_OWN_DATA.items()
        if p[name] and p[name] != _UNSET.get(name)
    ]
    if given:
        raise ValueError(
            f"{model.path} makes its own data (its train_dataloader()) and no data_url was "
            "given, so these do not apply: " + "; ".join(given)
        )


def _allowed_models(model: ModelRef, extra: list[str] | None) -> tuple[str, ...]:
    """``model`` and the further classes named, each importable here (checked now, before
    any work, so a typo fails the run rather than a later promotion)."""
    paths = tuple(dict.fromkeys([model.path, *(extra or ())]))
    for path in paths[1:]:
        ModelRef(path=path).resolve()
    return paths


def _data_parameters(model: ModelRef, p: dict[str, Any]) -> dict[str, Any]:
    """The data parameters given, else the model's ``data_defaults``, else none."""
    declared = getattr(model.resolve(), "data_defaults", None) or {}
    unknown = sorted(set(declared) - set(_DATA))
    if unknown:
        raise ModelError(f"{model.path}.data_defaults has unknown keys {unknown}; it takes {_DATA}")
    data = {name: p[name] if p[name] is not None else declared.get(name) for name in _DATA}
    data["label"] = data["label"] or "label"
    data["task"] = None if data["task"] in (None, "auto") else data["task"]
    return data


def _tune_parameters(config: TrainConfig, p: dict[str, Any]) -> dict[str, Any] | None:
    if not p["tune_trials"]:
        return None
    return {
        "config": config,
        "trials": p["tune_trials"],
        "epochs": p["tune_epochs"],
        "space": p["tune_space"],
        "metric": p["tune_metric"],
        "algorithm": p["tune_algorithm"],
        "max_concurrent": p["tune_max_concurrent"],
        "cpus_per_trial": p["tune_cpus_per_trial"],
        "gpus_per_trial": p["tune_gpus_per_trial"],
    }


def _loggers(names: list[str] | None) -> tuple[str, ...]:
    """The loggers asked for, each once; mlflow only where it is installed."""
    import importlib.util

    chosen = tuple(dict.fromkeys(names or ()))
    if "mlflow" in chosen and importlib.util.find_spec("mlflow") is None:
        raise ValueError(
            "loggers: mlflow needs the mlflow package where the flow runs (pip install mlflow); "
            "or use csv or tensorboard"
        )
    return chosen
