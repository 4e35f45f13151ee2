"""Register trained models, gate their promotion to production, and roll back by hand.

The Prefect tasks ``register`` and ``promote`` wrap :mod:`storage.registry`; the registry
of a pipeline lives under ``{storage_url}/registry``. From a shell::

    python -m ringflow.tasks.registry show     --storage-url .ringflow/storage --model digits
    python -m ringflow.tasks.registry rollback --storage-url .ringflow/storage --model digits
    python -m ringflow.tasks.registry promote  --storage-url .ringflow/storage --model digits \
        --version v0003
    python -m ringflow.tasks.registry history  --storage-url .ringflow/storage --model digits

Every move of the production pointer is a compare-and-swap (storage.registry): a rollback
that another writer beat is refused and moves nothing; a promotion by hand is applied to
wherever production stands.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence

from prefect import task
from prefect.exceptions import MissingContextError
from prefect.logging import get_logger, get_run_logger

from ringflow.storage.fs import resolve
from ringflow.storage.layout import Workspace
from ringflow.storage.registry import (
    ModelRegistry,
    RegistryError,
    dataset_fingerprint,
    production_checkpoint,
    promote_if_better,
)

__all__ = ["main", "model_registry", "promote", "register", "warm_start_checkpoint"]


def model_registry(storage_url: str, model: str) -> ModelRegistry:
    """The registry of the model named ``model`` in a pipeline's storage."""
    return ModelRegistry(Workspace(storage_url).registry, model)


def warm_start_checkpoint(storage_url: str, model: str) -> str | None:
    """The production checkpoint to warm-start a retrain from, or ``None`` if none yet."""
    return production_checkpoint(Workspace(storage_url).registry, model)


@task(name="register")
def register(
    checkpoint: str,
    storage_url: str,
    *,
    metrics: Mapping[str, float],
    dataset_url: str | None,
    run_key: str,
    model: str,
    data_fingerprint: str | None = None,
) -> dict:
    """Register a trained checkpoint as the model's next version; return its record.
    ``data_fingerprint``: what it was trained on where that is no dataset (a model's own
    data: its class), else the dataset's (``dataset_fingerprint``)."""
    record = model_registry(storage_url, model).register(
        checkpoint,
        metrics=metrics,
        data_fingerprint=data_fingerprint or dataset_fingerprint(dataset_url),
        dataset_url=dataset_url,
        run_key=run_key,
    )
    _logger().info("registered %s %s (%s)", model, record.version, record.uri)
    return record.as_dict()


_GATE_METRICS = ("test_accuracy", "test_loss", "val_accuracy", "val_loss")
"""What the gate compares by default, the first a version has."""


@task(name="promote")
def promote(
    version: str,
    storage_url: str,
    *,
    model: str,
    allowed: Sequence[str],
    metric: str | None = None,
    mode: str | None = None,
    tolerance: float = 0.0,
) -> dict:
    """Promote ``version`` to production if it is at least as good as the current one.

    The metric defaults to the first the version has of ``test_accuracy`` (higher is
    better), ``test_loss`` (lower is better), ``val_accuracy`` and ``val_loss`` (a model
    evaluated on its own validation loader), else ``test_loss``.

    When the two were trained on different data, both are re-evaluated on the candidate's
    held-out test split, each loaded only if its checkpoint holds one of the ``allowed``
    model classes (import paths); a version naming another class is not promoted, and a
    production version naming one stays in production. Returns the gate's decision
    (``promoted``, ``reason``, the values).
    """
    registry = model_registry(storage_url, model)
    if metric is None:
        stored = registry.get(version).metrics
        metric = next((m for m in _GATE_METRICS if m in stored), "test_loss")
    mode = mode or ("min" if metric.endswith("loss") else "max")
    decision = promote_if_better(
        registry,
        version,
        evaluate_fn=_test_split_evaluator(registry, version, allowed),
        metric=metric,
        mode=mode,
        tolerance=tolerance,
    )
    if decision.lost_to:
        _logger().warning(
            "production moved while %s was judged (lost to %s); it was judged again",
            version,
            ", ".join(decision.lost_to),
        )
    _logger().info("promotion gate: %s", decision.reason)
    return decision.as_dict()


def _test_split_evaluator(registry: ModelRegistry, version: str, allowed: Sequence[str]):
    """``uri -> test metrics`` on the held-out test split of ``version``'s dataset.

    The split is streamed, whatever its size: evaluation is one pass in order, so reading it
    a few row groups at a time (``storage.stream``) reads what reading it whole would, with
    memory bounded by a few row groups and one batch, and gives the same batches, so the
    same metrics."""
    from ringflow.engine import DataSpec
    from ringflow.engine import evaluate as evaluate_model

    dataset_url = registry.get(version).dataset_url
    if dataset_url is None:
        return None
    data = DataSpec(dataset_url=dataset_url, stream=True)
    return lambda uri: evaluate_model(uri, data, model=allowed, split="test")


def _logger():
    """The task run's logger, or the module's when a task body runs outside Prefect."""
    try:
        return get_run_logger()
    except MissingContextError:
        return get_logger(__name__)


# ---------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``show``, ``rollback`` or ``promote`` a version by hand, printing the pointer as JSON;
    ``history`` prints every move of the pointer, one JSON object a line."""
    parser = argparse.ArgumentParser(prog="python -m ringflow.tasks.registry", description=__doc__)
    parser.add_argument("command", choices=("show", "rollback", "promote", "history"))
    parser.add_argument("--storage-url", required=True, help="the pipeline's storage_url")
    parser.add_argument(
        "--model", help="the model's registry name; may be left out when the registry has one"
    )
    parser.add_argument("--version", help="promote: the version to put in production")
    parser.add_argument("--reason", default=None, help="recorded in the pointer's history")
    args = parser.parse_args(argv)
    try:
        args.model = args.model or _only_model(args.storage_url)
        registry = model_registry(args.storage_url, args.model)
        if args.command == "rollback":
            registry.rollback(reason=args.reason or "manual rollback")
        elif args.command == "promote":
            if not args.version:
                parser.error("promote needs --version")
            registry.promote(args.version, reason=args.reason or "manual promotion")
        elif args.command == "history":
            for move in registry.history():
                print(json.dumps(move))
            return 0
        pointer = registry.production()
    except RegistryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if pointer is None:
        print(json.dumps({"model": args.model, "production": None}))
        return 0
    shown = {"model": pointer.model, "production": pointer.version, "sequence": pointer.sequence}
    shown |= {"previous": list(pointer.previous), "reason": pointer.reason}
    shown["versions"] = [v.version for v in registry.versions()]
    print(json.dumps(shown))
    return 0


def _only_model(storage_url: str) -> str:
    """The name of the one model in the registry, for commands given no ``--model``."""
    fs, path = resolve(Workspace(storage_url).registry)
    names = (
        sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
        if fs.exists(path)
        else []
    )
    if len(names) != 1:
        raise RegistryError(f"name the model with --model; the registry holds {names or 'none'}")
    return names[0]


if __name__ == "__main__":
    raise SystemExit(main())
