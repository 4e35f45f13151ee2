"""Resharding on load: W data-parallel ranks into W', P pipeline stages into P', bitwise.

Optimizer state travels keyed by full parameter name (tensors in safetensors, the rest in
the manifest's JSON), so it lands on the right parameter whatever the new layout.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ringflow.models.digits import DigitsClassifier
from ringflow.storage import (
    CheckpointError,
    CheckpointStore,
    data_parallel_shards,
    load_data_parallel,
    load_optimizer_state_by_name,
    load_pipeline_stage,
    load_training_state,
    merge_optimizer_metadata,
    optimizer_state_by_name,
    pipeline_shards,
    rank_shard,
    training_state,
)

RUN = "reshard"


@pytest.fixture
def store() -> CheckpointStore:
    return CheckpointStore(f"memory://reshard-{uuid.uuid4().hex[:8]}")


def assert_bitwise(actual: Any, expected: Any, where: str = "") -> None:
    """Equal structure, equal types, tensors equal bit for bit (dtype included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_bitwise(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, list | tuple):
        assert type(actual) is type(expected), where
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_bitwise(a, e, f"{where}[{i}]")
    else:
        assert type(actual) is type(expected), where
        assert actual == expected, where


# ---------------------------------------------------------------------------- optimizers


class _IntStepMomentum(torch.optim.Optimizer):
    """Keeps its step count as a Python int and a tuple hyperparameter, unlike Adam."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.99)})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                state["step"] = state.get("step", 0) + 1
                state["avg"] = state.get("avg", torch.zeros_like(param)) * 0.9 + param.grad
                param.add_(state["avg"], alpha=-group["lr"])


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True, weight_decay=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.02),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "sgd-plain": lambda p: torch.optim.SGD(p, lr=0.1),
    "int-step": lambda p: _IntStepMomentum(p),
}


def train(model: nn.Module, optimizers: list[torch.optim.Optimizer], steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    inputs = model[0].in_features if isinstance(model, nn.Sequential) else 64
    for _ in range(steps):
        x = torch.rand(16, inputs, generator=generator) * 16
        loss = model(x).square().mean()
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_optimizer_state_round_trips_by_name_through_the_store(
    store: CheckpointStore, kind: str
) -> None:
    torch.manual_seed(0)
    model = DigitsClassifier(hidden=16)
    optimizer = OPTIMIZERS[kind](model.parameters())
    train(model, [optimizer], steps=3, seed=1)
    tensors, metadata = optimizer_state_by_name(optimizer, model.named_parameters())
    assert all(key.split("/")[0] in dict(model.named_parameters()) for key in tensors)
    store.save(RUN, step=3, shards={"optim": tensors}, metadata={"optimizer": metadata})

    torch.manual_seed(1)
    fresh = DigitsClassifier(hidden=16)
    fresh.load_state_dict(model.state_dict())
    restored = OPTIMIZERS[kind](fresh.parameters())
    loaded = store.load_latest(RUN)
    load_optimizer_state_by_name(
        restored, fresh.named_parameters(), loaded.shards["optim"], loaded.metadata["optimizer"]
    )
    assert_bitwise(restored.state_dict(), optimizer.state_dict())
    train(model, [optimizer], steps=2, seed=2)
    train(fresh, [restored], steps=2, seed=2)
    assert_bitwise(fresh.state_dict(), model.state_dict())


def test_optimizer_state_needs_names_for_every_parameter() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="named_parameters"):
        optimizer_state_by_name(optimizer, [("weight", model.weight)])


def test_state_that_is_neither_tensor_nor_number_is_refused() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.LBFGS(model.parameters())

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(torch.ones(1, 2)).square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)  # LBFGS keeps lists of tensors in its state
    with pytest.raises(ValueError, match="only tensors and plain numbers"):
        optimizer_state_by_name(optimizer, model.named_parameters())


# ---------------------------------------------------------------------------- data parallel


def train_data_parallel(world_size: int, steps: int) -> tuple[list[DigitsClassifier], list[Any]]:
    """W replicas stepping on gradients averaged over their slices of each batch."""
    torch.manual_seed(0)
    base = DigitsClassifier(hidden=16)
    replicas = [copy.deepcopy(base) for _ in range(world_size)]
    optimizers = [torch.optim.Adam(r.parameters(), lr=0.01) for r in replicas]
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.rand(30, 64, generator=generator) * 16
        y = torch.randint(0, 10, (30,), generator=generator)
        parts = list(zip(x.tensor_split(world_size), y.tensor_split(world_size), strict=True))
        for replica, (xs, ys) in zip(replicas, parts, strict=True):
            replica.zero_grad()
            weight = len(ys) / len(y)
            (nn.functional.cross_entropy(replica(xs), ys) * weight).backward()
        for name, _ in base.named_parameters():
            grads = [r.get_parameter(name).grad for r in replicas]
            total = torch.stack(grads).sum(0)
            for grad in grads:
                grad.copy_(total)
        for optimizer in optimizers:
            optimizer.step()
    return replicas, optimizers


@pytest.mark.parametrize("new_world_size", [1, 3])
def test_two_data_parallel_ranks_load_into_another_world_size(
    store: CheckpointStore, new_world_size: int
) -> None:
    replicas, optimizers = train_data_parallel(world_size=2, steps=4)
    tensors, optimizer_metadata = training_state(replicas[0], optimizers[0])
    per_rank = [
        {"sampler": torch.tensor([120, rank]), "rng": torch.get_rng_state()} for rank in (0, 1)
    ]
    checkpoint = store.save(
        RUN,
        step=4,
        shards=data_parallel_shards(tensors, per_rank),
        metadata={"optimizer": optimizer_metadata, "world_size": 2},
    )
    assert sorted(checkpoint.shards) == ["rank-00000", "rank-00001", "replicated"]

    for rank in range(new_world_size):
        state = load_data_parallel(store, checkpoint, rank=rank, world_size=new_world_size)
        torch.manual_seed(100 + rank)  # a different init, overwritten by the load
        model = DigitsClassifier(hidden=16)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        load_training_state(model, optimizer, state.replicated, checkpoint.metadata["optimizer"])
        assert state.saved_world_size == 2
        assert_bitwise(model.state_dict(), replicas[0].state_dict())
        assert_bitwise(optimizer.state_dict(), optimizers[0].state_dict())
        if rank < 2:
            assert_bitwise(state.own, per_rank[rank])
        else:
            assert state.own is None  # a rank the old run lacked starts its own RNG
        _same_after_one_more_step(model, optimizer, copy.deepcopy(replicas[0]), optimizers[0])


def _same_after_one_more_step(
    model: nn.Module, optimizer: Any, original: nn.Module, original_optimizer: Any
) -> None:
    """One Adam step on the same gradient: equal only if step counts and moments are."""
    twin = torch.optim.Adam(original.parameters(), lr=0.01)
    twin.load_state_dict(copy.deepcopy(original_optimizer.state_dict()))  # it would alias
    for m in (model, original):
        for name, param in m.named_parameters():
            param.grad = torch.full_like(param, 0.5) + len(name)
    optimizer.step()
    twin.step()
    assert_bitwise(model.state_dict(), original.state_dict())


def test_loading_a_rank_outside_the_world_is_refused(store: CheckpointStore) -> None:
    checkpoint = store.save(
        RUN, step=1, shards=data_parallel_shards({"w": torch.zeros(1)}, [{"r": torch.zeros(1)}])
    )
    with pytest.raises(ValueError, match="rank"):
        load_data_parallel(store, checkpoint, rank=2, world_size=2)
    assert rank_shard(0) in checkpoint.shards


# ---------------------------------------------------------------------------- pipeline


def make_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
        nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4),
    )  # fmt: skip


def stages_of(model: nn.Sequential, split: list[set[int]]) -> list[nn.Sequential]:
    """Stage modules sharing ``model``'s layers, keeping their full names (others: Identity)."""
    return [
        nn.Sequential(*(layer if i in owned else nn.Identity() for i, layer in enumerate(model)))
        for owned in split
    ]


TWO_STAGES = [{0, 1, 2, 3}, {4, 5, 6}]


def save_two_stages(store: CheckpointStore, lrs: tuple[float, float] = (0.01, 0.01)) -> Any:
    model = make_model(0)
    stages = stages_of(model, TWO_STAGES)
    optimizers = [
        torch.optim.Adam(s.parameters(), lr=lr) for s, lr in zip(stages, lrs, strict=True)
    ]
    train(model, optimizers, steps=3, seed=5)
    states = [training_state(s, o) for s, o in zip(stages, optimizers, strict=True)]
    checkpoint = store.save(
        RUN,
        step=3,
        shards=pipeline_shards([tensors for tensors, _ in states]),
        metadata={"optimizer": merge_optimizer_metadata(m for _, m in states), "stages": 2},
    )
    return model, optimizers, checkpoint


@pytest.mark.parametrize(
    "split", [[set(range(7))], [{0, 1}, {2, 3}, {4, 5, 6}]], ids=["1-stage", "3-stages"]
)
def test_two_pipeline_stages_load_into_another_stage_count(
    store: CheckpointStore, split: list[set[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizers, checkpoint = save_two_stages(store)
    reads: list[list[str]] = []
    load = store.load
    monkeypatch.setattr(
        store, "load", lambda c, shards: reads.append(shards) or load(c, shards=shards)
    )

    fresh = make_model(seed=42)
    new_stages = stages_of(fresh, split)
    new_optimizers = [torch.optim.Adam(s.parameters(), lr=0.01) for s in new_stages]
    for stage, optimizer in zip(new_stages, new_optimizers, strict=True):
        tensors = load_pipeline_stage(store, checkpoint, names=stage.state_dict().keys())
        load_training_state(stage, optimizer, tensors, checkpoint.metadata["optimizer"])

    assert_bitwise(fresh.state_dict(), model.state_dict())
    assert_bitwise(_optimizer_by_name(fresh, new_optimizers), _optimizer_by_name(model, optimizers))
    if len(split) == 3:
        assert reads[0] == ["stage-00000"]  # stage {0, 1} reads only the shard holding it
    train(model, optimizers, steps=2, seed=9)
    train(fresh, new_optimizers, steps=2, seed=9)
    assert_bitwise(fresh.state_dict(), model.state_dict())


def _optimizer_by_name(model: nn.Module, optimizers: list[Any]) -> dict[str, Any]:
    """Every parameter's optimizer tensors, hyperparameters and other state, by name."""
    merged: dict[str, Any] = {}
    for optimizer in optimizers:
        tensors, metadata = optimizer_state_by_name(optimizer, model.named_parameters())
        merged.update(tensors)
        for group in metadata["groups"]:
            merged.update({f"{name}/hyper": group["hyper"] for name in group["params"]})
        merged.update({f"{name}/state": entry for name, entry in metadata["state"].items()})
    return merged


def test_merging_stages_with_different_hyperparameters_into_one_group_is_refused(
    store: CheckpointStore,
) -> None:
    _, _, checkpoint = save_two_stages(store, lrs=(0.01, 0.02))
    fresh = make_model(seed=1)
    optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
    tensors = load_pipeline_stage(store, checkpoint, names=fresh.state_dict().keys())
    with pytest.raises(CheckpointError, match="different hyperparameters"):
        load_training_state(fresh, optimizer, tensors, checkpoint.metadata["optimizer"])
    # Two groups, as the stages had, load fine.
    params = dict(fresh.named_parameters())
    first = [p for n, p in params.items() if int(n.split(".")[0]) <= 3]
    second = [p for n, p in params.items() if int(n.split(".")[0]) > 3]
    grouped = torch.optim.Adam([{"params": first, "lr": 0.01}, {"params": second, "lr": 0.02}])
    load_training_state(fresh, grouped, tensors, checkpoint.metadata["optimizer"])
    assert [g["lr"] for g in grouped.param_groups] == [0.01, 0.02]


def test_a_name_no_stage_holds_is_reported(store: CheckpointStore) -> None:
    _, _, checkpoint = save_two_stages(store)
    with pytest.raises(CheckpointError, match="no stage holds"):
        load_pipeline_stage(store, checkpoint, names=["9.weight"])
