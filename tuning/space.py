"""A search's space: dimensions parsed from JSON (``choice``, ``uniform``, ``loguniform``,
``randint``, or a list), checked against the model's keywords and ``TrainConfig``'s tunable
fields, and the seeded proposers that walk it (``random``, ``evolution``), each proposing
exactly what an uninterrupted search would have after a resume.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringflow.engine.config import TrainConfig
from ringflow.tuning.records import EPOCH, History, is_finite

log = logging.getLogger("ringflow.engine")

_SEARCH_OWNED = ("workers", "epochs", "cpus_per_worker", "checkpoint_every")


TUNABLE_CONFIG = tuple(
    f.name for f in dataclasses.fields(TrainConfig) if f.name not in _SEARCH_OWNED
)
"""``TrainConfig`` fields a search space may name besides the model's keywords (batch size,
seed, collective, compression, bucket size...). Workers, epochs, CPUs and checkpointing are
the search's own settings (:class:`SearchConfig`)."""


_KINDS = ("choice", "uniform", "loguniform", "randint")


@dataclass(frozen=True)
class Dimension:
    """One searched name: a list of choices or a numeric range."""

    name: str
    kind: str
    values: tuple[Any, ...]
    """The choices, or ``(low, high)`` (``high`` excluded for ``randint``)."""

    def samples(self) -> list[Any]:
        """Values that probe the range's ends, for validation."""
        if self.kind == "choice":
            return list(self.values)
        low, high = self.values
        return [low, high - 1] if self.kind == "randint" else [low, high]

    def sample(self, rng: random.Random) -> Any:
        low, high = self.values if self.kind != "choice" else (0, 0)
        if self.kind == "choice":
            return rng.choice(self.values)
        if self.kind == "uniform":
            return rng.uniform(low, high)
        if self.kind == "loguniform":
            return math.exp(rng.uniform(math.log(low), math.log(high)))
        return rng.randrange(low, high)

    def mutate(self, rng: random.Random, value: Any) -> Any:
        """A neighbour of ``value``: the next choice, or a step of a quarter of the range."""
        if self.kind == "choice":
            if value not in self.values or len(self.values) == 1:
                return rng.choice(self.values)
            i = self.values.index(value) + rng.choice((-1, 1))
            return self.values[min(max(i, 0), len(self.values) - 1)]
        low, high = self.values
        if self.kind == "loguniform":
            moved = math.exp(math.log(value) + rng.gauss(0, 0.25 * math.log(high / low)))
            return min(max(moved, low), high)
        moved = value + rng.gauss(0, 0.25 * (high - low))
        if self.kind == "randint":
            return min(max(round(moved), low), high - 1)
        return min(max(moved, low), high)


def parse_space(space: dict[str, Any]) -> list[Dimension]:
    """Read a JSON search space: name to a list of choices or ``{kind: [low, high]}``.

    Kinds: ``{"choice": [...]}`` (a bare list means the same), ``{"uniform": [low, high]}``,
    ``{"loguniform": [low, high]}`` (low > 0), ``{"randint": [low, high]}`` (high excluded).

    Raises:
        ValueError: an empty space or an entry of another shape.
    """
    if not isinstance(space, dict) or not space:
        raise ValueError(
            "the search space is empty: give at least one name, e.g. "
            '{"lr": {"loguniform": [0.001, 0.1]}, "hidden": [32, 64, 128]}'
        )
    return [_dimension(name, spec) for name, spec in space.items()]


def _dimension(name: str, spec: Any) -> Dimension:
    if isinstance(spec, list):
        spec = {"choice": spec}
    if isinstance(spec, dict) and len(spec) == 1:
        kind, values = next(iter(spec.items()))
        if kind == "choice" and isinstance(values, list) and values:
            return Dimension(name, kind, tuple(values))
        if kind in _KINDS and _is_range(kind, values):
            return Dimension(name, kind, (values[0], values[1]))
    raise ValueError(
        f"search space entry {name!r} must be a non-empty list of choices or one of "
        "{'choice': [...]}, {'uniform' | 'loguniform' | 'randint': [low, high]} with "
        f"low < high (low > 0 for loguniform, integers for randint); got {spec!r}"
    )


def _is_range(kind: str, values: Any) -> bool:
    if not (isinstance(values, list | tuple) and len(values) == 2):
        return False
    low, high = values
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if not numbers or not low < high:
        return False
    if kind == "loguniform":
        return low > 0
    return kind != "randint" or all(isinstance(v, int) for v in values)


class _Random:
    """The base configuration as trial ``00000``, then independent samples: trial ``i`` is
    drawn from a generator seeded by ``(seed, i)``, so a resumed search proposes exactly what
    the uninterrupted one would have."""

    def __init__(self, dims: list[Dimension], base: dict[str, Any], *, seed: int):
        self.dims, self.base, self.seed = dims, base, seed

    def suggest(self, trial_id: str) -> dict[str, Any]:
        index = int(trial_id)
        if index == 0:
            return dict(self.base)
        rng = random.Random(f"{self.seed}:{index}")
        return {d.name: d.sample(rng) for d in self.dims}

    def observe(self, trial_id: str, result: dict) -> None:
        pass  # proposals do not depend on results

    def resume(self, history: History, *, base_trial: str) -> None:
        pass


def _random_search(
    dims: list[Dimension], base: dict[str, Any], *, metric: str, mode: str, seed: int
) -> _Random:
    """Random sampling, the base configuration first (see :class:`_Random`)."""
    return _Random(dims, base, seed=seed)


def _evolution_search(
    dims: list[Dimension], base: dict[str, Any], *, metric: str, mode: str, seed: int
) -> _Evolution:
    """Seeded mutation of the best trial so far (see :class:`_Evolution`)."""
    return _Evolution(dims, base, metric=metric, mode=mode, seed=seed)


SEARCH_ALGORITHMS: dict[str, Callable[..., Any]] = {
    "random": _random_search,
    "evolution": _evolution_search,
}
"""Search algorithms by name: each returns a proposer with ``suggest(trial_id)``,
``observe(trial_id, result)`` and ``resume(history, base_trial=...)``. Both are plain Python,
rebuilt from the search's records when it resumes: the Ray searchers that model the metric
(Optuna, HyperOpt, BayesOpt, ...) each need a package not installed here, and keep their
state only as pickles."""


class _Evolution:
    """The base configuration, then ``initial`` random ones, then mutations of the best.

    "Best" ranks trials by how far the early-stopping scheduler let them go, then by the
    metric there, so a trial stopped early never outranks one that outlived it. Seeded: the
    same results give the same proposals. Plain Python, so it is tested without Ray.
    """

    def __init__(self, dims, base, *, metric: str, mode: str, seed: int, initial: int = 3):
        self.dims, self.queue, self.initial = dims, [dict(base)], initial
        self.metric, self.sign = metric, 1.0 if mode == "max" else -1.0
        self.rng = random.Random(seed)
        self.configs: dict[str, dict[str, Any]] = {}
        self.scores: dict[str, tuple[int, float]] = {}

    def suggest(self, trial_id: str) -> dict[str, Any]:
        if self.queue:
            config = self.queue.pop(0)
        elif len(self.configs) <= self.initial or not self.scores:
            config = {d.name: d.sample(self.rng) for d in self.dims}
        else:
            config = self._mutate(self.configs[max(self.scores, key=self.scores.__getitem__)])
        self.configs[trial_id] = config
        return dict(config)

    def _mutate(self, parent: dict[str, Any]) -> dict[str, Any]:
        child = dict(parent)
        changed = [d for d in self.dims if self.rng.random() < 1 / len(self.dims)]
        for dim in changed or [self.rng.choice(self.dims)]:
            child[dim.name] = dim.mutate(self.rng, parent[dim.name])
        return child

    def observe(self, trial_id: str, result: dict) -> None:
        value = result.get(self.metric)
        if trial_id in self.configs and EPOCH in result and is_finite(value):
            self.scores[trial_id] = (int(result[EPOCH]), self.sign * float(value))

    def resume(self, history: History, *, base_trial: str) -> None:
        """Take back the configurations and results of the trials recorded so far."""
        for trial_id, trial in history.trials.items():
            if trial.params is None:
                continue
            self.configs[trial_id] = dict(trial.params)
            for result in trial.curve():
                self.observe(trial_id, result)
        if base_trial in self.configs:
            self.queue.clear()


def check_names(
    module_cls: type, base_hparams: dict, train_config: TrainConfig, dims: list[Dimension]
) -> dict[str, Any]:
    """Every searched name is taken by the model or the config and accepts its values.

    Returns:
        The base configuration's value of every searched name.
    """
    params = inspect.signature(module_cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    model_names = {n for n in params if n != "self"}
    base: dict[str, Any] = {}
    for dim in dims:
        if dim.name in TUNABLE_CONFIG:
            base[dim.name] = getattr(train_config, dim.name)
            for value in dim.samples():
                _try(dim, value, lambda v, d=dim: train_config.with_changes(**{d.name: v}))
        elif dim.name in model_names or takes_any:
            if dim.name not in base_hparams and dim.name in params:
                default = params[dim.name].default
                if default is inspect.Parameter.empty:
                    raise ValueError(f"{dim.name!r} has no base value: add it to base_hparams")
                base[dim.name] = default
            else:
                base[dim.name] = base_hparams[dim.name]
            for value in dim.samples():
                _try(dim, value, lambda v, d=dim: module_cls(**{**base_hparams, d.name: v}))
        else:
            raise ValueError(
                f"search space names {dim.name!r}, which {module_cls.__name__} does not take; "
                f"it takes {sorted(model_names)}, and the search may also set {TUNABLE_CONFIG}"
            )
    return base


def _try(dim: Dimension, value: Any, build: Callable[[Any], Any]) -> None:
    try:
        build(value)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"search space entry {dim.name!r} allows {value!r}, which is rejected: {err}"
        ) from err
