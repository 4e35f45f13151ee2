"""Sharded data parallel, ZeRO-1 (``TrainConfig.shard="optimizer"``), ZeRO-2
(``"gradients"``) and ZeRO-3 (``"parameters"``): each worker keeps the optimizer state of its
shard of the parameters (under ZeRO-2 its shard of the gradients too, under ZeRO-3 of the
parameters too), and training ends where ``shard="none"`` ends."""

from __future__ import annotations

import copy
import signal
import time
from pathlib import Path

import pytest
import torch

from ringflow.engine import TrainConfig, fit
from ringflow.models.digits import DigitsClassifier
from tests.support.fitting import KILLED_PEER_DEADLINE_S, die_once, relative_difference

HPARAMS = {"hidden": 32, "lr": 0.01}
MODES = ("optimizer", "gradients", "parameters")
BUCKET_MB = 0.001
"""Two buckets of the digits model (the last layer's, the first's), each cut by the shards'
edges inside a parameter: under ZeRO-3, two units gathered and freed in turn."""


class _Measured(DigitsClassifier):
    """Writes the bytes of its optimizer's state tensors, per rank, where training ends, the
    state itself (this rank's shard of it, sharded), and the bytes of the memory its
    gradients and its parameters take (the module's parameters' and the optimizer's:
    storage freed holds none)."""

    def __init__(self, record: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.record = record

    def on_train_end(self) -> None:
        optimizer = self.optimizers()
        optimizer = getattr(optimizer, "optimizer", optimizer)
        size = sum(
            value.numel() * value.element_size()
            for entry in optimizer.state.values()
            for value in entry.values()
            if isinstance(value, torch.Tensor)
        )
        rank = self.trainer.global_rank
        Path(self.record, str(rank)).write_text(str(size))
        Path(self.record, f"steps-{rank}").write_text(str(self.trainer.global_step))
        params = [*self.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]
        storages = {
            p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
            for p in params
            if p.grad is not None
        }
        Path(self.record, f"grads-{rank}").write_text(str(sum(storages.values())))
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
        Path(self.record, f"params-{rank}").write_text(str(sum(storages.values())))
        torch.save(optimizer.state_dict(), Path(self.record, f"state-{rank}.pt"))


class _KillsItself(_Measured):
    """Rank 1 SIGKILLs its own process in the step at global step ``dies_at``, once (the
    file ``mark`` says it did): a worker lost at a chosen step, whatever the timing."""

    def __init__(self, dies_at: int = -1, mark: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.dies_at, self.mark = dies_at, mark

    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1 and self.global_step == self.dies_at:
            die_once(self.mark)
        return super().training_step(batch, batch_idx)


def _fit(
    digits,
    tmp_path,
    name: str,
    *,
    store_url=None,
    run_key=None,
    module=_Measured,
    hparams=None,
    on_epoch=None,
    callbacks=None,
    **config,
):
    record = tmp_path / f"bytes-{run_key or name}"  # a resumed run's hparams are the same
    record.mkdir(exist_ok=True)
    settings = {"workers": 2, "epochs": 3, "batch_size": 64, "seed": 3, **config}
    result = fit(
        module,
        hparams={**HPARAMS, **(hparams or {}), "record": str(record)},
        data=digits,
        config=TrainConfig(**settings),
        checkpoint_uri=str(tmp_path / name),
        store_url=store_url,
        run_key=run_key,
        on_epoch=on_epoch,
        callbacks=callbacks,
    )
    state_bytes = [int((record / str(r)).read_text()) for r in range(settings["workers"])]
    return result, state_bytes


@pytest.mark.ray
def test_sharded_adam_on_two_workers_ends_where_unsharded_ends_with_half_the_state(
    ray_session, digits, tmp_path
):
    """69 steps of Adam, ZeRO-1, ZeRO-2 and ZeRO-3: the weights within 1e-6 of
    ``shard="none"``'s, and each worker holds about half of the optimizer state (two buckets:
    a parameter cut by a shard's edge is stepped in two pieces, one on each worker); under
    ZeRO-2 and ZeRO-3 about half of the gradients too, where ZeRO-1 keeps the whole buckets;
    under ZeRO-3 about half of the parameters too, where the others keep them whole."""
    none, whole = _fit(digits, tmp_path, "none", bucket_mb=BUCKET_MB)
    initial = DigitsClassifier(hidden=32).state_dict()
    assert relative_difference(none.state_dict, initial) > 1e-2  # training moved the weights
    assert whole[0] == whole[1] > 0
    for mode in MODES:
        sharded, parts = _fit(digits, tmp_path, mode, bucket_mb=BUCKET_MB, shard=mode)
        assert relative_difference(sharded.state_dict, none.state_dict) < 1e-6, mode
        assert all(part <= 0.55 * whole[0] for part in parts), (mode, parts, whole)
    grads = _gradient_bytes(tmp_path, "none", 2)
    assert grads[0] == grads[1] > 0
    assert all(part >= grads[0] for part in _gradient_bytes(tmp_path, "optimizer", 2))
    for mode in ("gradients", "parameters"):
        parts = _gradient_bytes(tmp_path, mode, 2)
        assert all(part <= 0.55 * grads[0] for part in parts), (mode, parts, grads)
    weights = _parameter_bytes(tmp_path, "none", 2)
    assert weights[0] == weights[1] > 0
    assert all(part >= weights[0] for part in _parameter_bytes(tmp_path, "gradients", 2))
    parts = _parameter_bytes(tmp_path, "parameters", 2)
    assert all(part <= 0.55 * weights[0] for part in parts), (parts, weights)


@pytest.mark.ray
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_sharded_with_accumulation_and_clipping_on_four_workers_ends_where_unsharded_ends(
    ray_session, digits, tmp_path, precision
):
    """Accumulation over 2 batches and clipping by the global norm (small enough to clip
    every step: each worker's shard alone has a smaller norm) on 4 workers, each holding
    about a quarter of the state, ZeRO-1, ZeRO-2 (whose every batch's gradients are
    reduce-scattered and added up in each worker's quarter of them) and ZeRO-3, whose
    workers each hold at most 0.3 of what an unsharded worker holds between steps:
    parameters, gradients and optimizer state. Under bf16-mixed too, where weights a last
    bit apart would drift apart (each forward rounds them to bfloat16): where it clips, the
    sharded norm is shard="none"'s, bit for bit."""
    config = {
        "workers": 4,
        "epochs": 5,  # 12 optimizer steps an epoch: 60
        "accumulate_grad_batches": 2,
        "gradient_clip_val": 0.05,
        "commit_every": 4,
        "cpus_per_worker": 0.5,
        "bucket_mb": BUCKET_MB,
        "precision": precision,
    }
    none, whole = _fit(digits, tmp_path, "none4", **config)
    assert int((tmp_path / "bytes-none4" / "steps-0").read_text()) == 60  # optimizer steps
    for mode in MODES:
        sharded, parts = _fit(digits, tmp_path, f"{mode}4", shard=mode, **config)
        assert relative_difference(sharded.state_dict, none.state_dict) < 1e-6, mode
        assert all(part <= 0.3 * whole[0] for part in parts), (mode, parts, whole)
    grads = _gradient_bytes(tmp_path, "none4", 4)
    for mode in ("gradients", "parameters"):
        parts = _gradient_bytes(tmp_path, f"{mode}4", 4)
        assert all(part <= 0.3 * grads[0] for part in parts), (mode, parts, grads)
    held = _held_bytes(tmp_path, "none4", 4)
    parts = _held_bytes(tmp_path, "parameters4", 4)
    assert all(part <= 0.3 * held[0] for part in parts), (parts, held)
    # The clipping acted (so a norm of one shard's gradients alone would have shown):
    unclipped = {**config, "gradient_clip_val": None, "workers": 2}
    assert (
        relative_difference(
            _fit(digits, tmp_path, "unclipped", **unclipped)[0].state_dict, none.state_dict
        )
        > 1e-3
    )


@pytest.mark.ray
@pytest.mark.parametrize("shard", ["optimizer", "parameters"])
def test_a_sharded_run_resumes_bitwise_and_its_checkpoint_loads_unsharded(
    ray_session, digits, tmp_path, shard
):
    """The checkpoint is each worker's shard, written by that worker: a sharded run resumed
    ends bit for bit as the uninterrupted one, and the same checkpoint resumes unsharded to
    where an unsharded run ends (same math, another summation order)."""
    from ringflow.storage import CheckpointStore

    store = str(tmp_path / "store")
    every = {"shard": shard, "checkpoint_every": 10, "epochs": 3, "bucket_mb": BUCKET_MB}
    reference = _fit(digits, tmp_path, "reference", **every)[0]
    _fit(digits, tmp_path, "first", store_url=store, run_key="r", **{**every, "epochs": 2})
    assert sorted(CheckpointStore(store).checkpoints("r")[-1].shards) == [
        "zero-00000",
        "zero-00001",
    ]
    resumed = _fit(digits, tmp_path, "resumed", store_url=store, run_key="r", **every)[0]
    assert resumed.resumed_from == 46
    assert resumed.state_dict.keys() == reference.state_dict.keys()
    for name, tensor in reference.state_dict.items():
        assert torch.equal(resumed.state_dict[name], tensor), name
    unsharded = _fit(
        digits, tmp_path, "unsharded", store_url=store, run_key="r", epochs=4, bucket_mb=BUCKET_MB
    )[0]
    assert unsharded.resumed_from == 69
    plain = _fit(digits, tmp_path, "plain", epochs=4, bucket_mb=BUCKET_MB)[0]
    assert relative_difference(unsharded.state_dict, plain.state_dict) < 1e-5


@pytest.mark.ray
def test_sharded_parameters_evaluate_where_a_worker_has_no_part_and_write_model_checkpoints(
    ray_session, digits, tmp_path
):
    """Batches of 179: the validation split's last batch (1 of its 180 samples) leaves
    worker 1 nothing, so each evaluation gathers the whole model at once (a forward on one
    worker alone would gather alone); the metrics and weights are ``shard="none"``'s.
    ``ModelCheckpoint``'s file, written by rank 0 from the weights and optimizer state every
    worker gathered, holds the run's weights and ``shard="none"``'s optimizer state, and
    loads unsharded."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    config = {"batch_size": 179, "epochs": 2, "bucket_mb": BUCKET_MB}
    plain = ModelCheckpoint(dirpath=str(tmp_path / "ckpt-none"), save_last=True)
    none, _ = _fit(digits, tmp_path, "none", callbacks=[plain], **config)
    saved = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    sharded, _ = _fit(
        digits, tmp_path, "parameters", shard="parameters", callbacks=[saved], **config
    )
    assert relative_difference(sharded.state_dict, none.state_dict) < 1e-6
    for mine, theirs in zip(sharded.history, none.history, strict=True):
        assert mine.metrics.keys() == theirs.metrics.keys()
        assert mine.metrics["val_loss"] == pytest.approx(theirs.metrics["val_loss"], rel=1e-6)
    last = _Measured.load_from_checkpoint(saved.last_model_path)
    for name, tensor in sharded.state_dict.items():
        assert torch.equal(last.state_dict()[name], tensor), name
    # The file's optimizer state is the whole one, gathered from every worker's shard, in
    # the format shard="none" writes (not rank 0's pieces).
    ours, theirs = (
        torch.load(c.last_model_path, weights_only=False)["optimizer_states"]
        for c in (saved, plain)
    )
    assert len(ours) == len(theirs) == 1
    assert ours[0]["param_groups"] == theirs[0]["param_groups"]
    assert ours[0]["state"].keys() == theirs[0]["state"].keys()
    for index, entry in theirs[0]["state"].items():
        tensors = {k: v for k, v in entry.items() if torch.is_tensor(v) and v.dim()}
        mine = {k: ours[0]["state"][index][k] for k in tensors}
        assert relative_difference(mine, tensors) < 1e-6, index


class _PenalisesAfterForward(DigitsClassifier):
    """A weight penalty in ``training_step`` that reads the first layer's weights after the
    forward (under ZeRO-3 its unit is freed by then); each read is marked in ``marks``."""

    def __init__(self, marks: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.marks = marks

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        with open(self.marks, "a") as marks:
            marks.write(f"{self.global_rank}\n")
        return loss + 1e-4 * sum(p.pow(2).sum() for p in self.net[0].parameters())


class _ReadsWeightsAfterTheBatch(_PenalisesAfterForward):
    """Logs the first layer's weight norm in ``on_train_batch_end``, after the step."""

    def training_step(self, batch, batch_idx):
        return DigitsClassifier.training_step(self, batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with open(self.marks, "a") as marks:
            marks.write(f"{self.global_rank}\n")
        self.log("first_weight_norm", self.net[0].weight.norm())


@pytest.mark.ray
@pytest.mark.parametrize(
    ("module", "hook"),
    [
        (_PenalisesAfterForward, "training_step"),
        (_ReadsWeightsAfterTheBatch, "on_train_batch_end"),
    ],
)
def test_a_weight_read_outside_its_forward_under_zero3_fails_the_run_at_once_naming_the_hook(
    ray_session, digits, tmp_path, caplog, module, hook
):
    """Under ZeRO-3 a layer's weights exist only inside the forward of the module that owns
    them: a penalty that reads them after the forward, or a hook after the step, raises at
    its first read (never reads freed memory: no crashed worker, no retry), and the run ends
    with one line naming the hook, the weight and what to do."""
    import logging

    from ringflow.engine import ModelError

    caplog.set_level(logging.INFO, logger="ringflow.engine")
    marks = tmp_path / "marks"
    config = {"workers": 2, "epochs": 1, "batch_size": 64, "seed": 3, "bucket_mb": BUCKET_MB}
    with pytest.raises(ModelError) as failed:
        fit(
            module,
            hparams={**HPARAMS, "marks": str(marks)},
            data=digits,
            config=TrainConfig(shard="parameters", cpus_per_worker=0.5, **config),
            checkpoint_uri=str(tmp_path / "model"),
        )
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(
        f"{module.__name__}.{hook} raised RuntimeError: the weight 'net.0.weight' was read "
        "where it is not gathered: under shard='parameters'"
    ), message
    assert "or use shard='gradients'" in message, message
    assert sorted(marks.read_text().split()) in (["0"], ["1"], ["0", "1"])  # the first batch
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "lost" in m or "starting again" in m], said
    # The same module trains under shard="gradients", where every worker keeps whole weights.
    marks.unlink()
    fit(
        module,
        hparams={**HPARAMS, "marks": str(marks)},
        data=digits,
        config=TrainConfig(shard="gradients", **config),
        checkpoint_uri=str(tmp_path / "gradients"),
    )


def _gradient_bytes(tmp_path, name: str, workers: int) -> list[int]:
    """Each rank's bytes of gradients where the run ``name`` ended (:class:`_Measured`)."""
    return [int((tmp_path / f"bytes-{name}" / f"grads-{r}").read_text()) for r in range(workers)]


def _parameter_bytes(tmp_path, name: str, workers: int) -> list[int]:
    """Each rank's bytes of parameters where the run ``name`` ended (:class:`_Measured`)."""
    return [int((tmp_path / f"bytes-{name}" / f"params-{r}").read_text()) for r in range(workers)]


def _held_bytes(tmp_path, name: str, workers: int) -> list[int]:
    """Each rank's bytes held between steps where the run ``name`` ended: parameters,
    gradients and optimizer state (:class:`_Measured`)."""
    record = tmp_path / f"bytes-{name}"
    return [
        sum(int((record / f"{kind}{r}").read_text()) for kind in ("params-", "grads-", ""))
        for r in range(workers)
    ]


def _optimizer_states(tmp_path, name: str, workers: int) -> list[dict]:
    """Each rank's optimizer ``state_dict`` where the run ``name`` ended (:class:`_Measured`)."""
    return [torch.load(tmp_path / f"bytes-{name}" / f"state-{r}.pt") for r in range(workers)]


def _assert_same_optimizer_state(got: dict, expected: dict) -> None:
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        assert got["state"][index].keys() == entry.keys(), index
        for key, value in entry.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


@pytest.mark.ray
@pytest.mark.parametrize(
    ("shard", "kill"),
    [
        ("optimizer", "by the driver after an epoch"),
        ("optimizer", "by itself between commits"),
        ("gradients", "by itself between commits"),
        ("parameters", "by the driver after an epoch"),
        ("parameters", "by itself between commits"),
    ],
)
def test_a_worker_killed_and_replaced_at_once_under_shard_ends_bit_for_bit(
    ray_session, digits, tmp_path, shard, kill
):
    """``min_workers`` left out: a worker SIGKILLed mid-epoch is replaced at once, the
    survivor rolling back to the last in-memory commit and the replacement adopting it, each
    taking its shard of the commit's whole optimizer state. The run ends bit for bit as the
    uninterrupted one: the weights, and every worker's shard of the optimizer state.
    Killed by itself at step 35: the commit of step 30 is one the workers made at the end of
    a call of steps while they ran step 30 ahead of the next call (steps sent ahead)."""
    from tests.test_elastic import _strike

    config = {
        "shard": shard,
        "epochs": 3,
        "bucket_mb": BUCKET_MB,  # two buckets, parameters cut by a shard's edge
        "cpus_per_worker": 0.5,
        "collective_timeout_s": KILLED_PEER_DEADLINE_S,
    }
    reference, _ = _fit(digits, tmp_path, "reference", module=_KillsItself, **config)
    if kill.startswith("by the driver"):
        on_epoch, struck = _strike(signal.SIGKILL, after_epoch=0, delay_s=0.0)
        replaced, _ = _fit(digits, tmp_path, "replaced", on_epoch=on_epoch, **config)
        assert struck, "no worker was killed"
    else:
        mark = tmp_path / "killed"
        hparams = {"dies_at": 35, "mark": str(mark)}
        replaced, _ = _fit(
            digits, tmp_path, "replaced", module=_KillsItself, hparams=hparams, **config
        )
        assert mark.exists()
    assert [e.kind for e in replaced.events] == ["lost", "rollback", "joined", "recovered"]
    for name, tensor in reference.state_dict.items():
        assert torch.equal(replaced.state_dict[name], tensor), name
    expected = _optimizer_states(tmp_path, "reference", 2)
    for got, want in zip(_optimizer_states(tmp_path, "replaced", 2), expected, strict=True):
        _assert_same_optimizer_state(got, want)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"shard": "zero"}, "shard must be one of"),
        ({"shard": "gradients", "compression": "powersgd"}, "does not compose with compression"),
        ({"shard": "parameters", "compression": "bf16"}, None),
        ({"shard": "parameters", "compression": "powersgd"}, "does not compose with compression"),
        ({"shard": "parameters", "workers": 4, "min_workers": 2}, None),
        ({"shard": "optimizer", "compression": "powersgd"}, "does not compose with compression"),
        ({"shard": "optimizer", "precision": "16-mixed"}, "does not compose with precision"),
        ({"shard": "optimizer", "workers": 3, "min_workers": 2}, None),
    ],
)
def test_shard_modes_not_composing_are_refused_in_one_line(config, message):
    if message is None:  # composes
        assert TrainConfig(**config).shard == config["shard"]
        return
    with pytest.raises(ValueError, match=message) as raised:
        TrainConfig(**config)
    assert "\n" not in str(raised.value)


def test_an_optimizer_that_is_not_elementwise_is_refused_in_one_line():
    from ringflow.engine.errors import ModelError
    from ringflow.engine.sharding import check_elementwise

    check_elementwise(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]))
    with pytest.raises(ModelError, match="LBFGS may not update element by element"):
        check_elementwise(torch.optim.LBFGS([torch.zeros(1, requires_grad=True)]))


@pytest.mark.ray
def test_manual_optimisation_under_shard_is_refused_before_any_worker_starts(tmp_path, ray_session):
    from ringflow.engine import ModelError
    from tests.test_manual_optimisation import NoiseFromData, images, under_ringflow

    with pytest.raises(ModelError, match="does not compose with manual optimisation") as raised:
        under_ringflow(NoiseFromData, {}, images(), tmp_path, workers=2, shard="optimizer")
    assert "\n" not in str(raised.value)


def _layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
    )


class _ThreadRanks:
    """``size`` ranks in one process, one thread each, meeting at a barrier."""

    def __init__(self, size: int) -> None:
        import threading

        self.size, self.barrier = size, threading.Barrier(size)
        self.sent: list[torch.Tensor | None] = [None] * size

    def rank(self, rank: int):
        from ringflow.engine.collective import Collective
        from ringflow.engine.collective.base import CompletedWork

        ranks = self

        class _Rank(Collective):
            def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
                ranks.sent[self.rank] = tensor.clone()
                ranks.barrier.wait()
                got = list(ranks.sent)
                ranks.barrier.wait()
                return got

            def all_gather(self, tensor):
                return self._exchange(tensor)

            def allreduce_async_(self, tensor, *, op="sum"):
                tensor.copy_(torch.stack(self._exchange(tensor)).sum(0))
                return CompletedWork(tensor)

            def broadcast_(self, tensor, *, src=0):
                return tensor.copy_(self._exchange(tensor)[src])

        return _Rank(rank=rank, world_size=self.size)


@pytest.mark.parametrize(("size", "bucket_bytes"), [(2, 300 * 4), (4, 300 * 4), (4, 10**6), (3, 1)])
def test_the_sharded_gradient_norm_is_the_whole_gradients_norm_bit_for_bit(size, bucket_bytes):
    """``ShardedOptimizer.whole_norm`` on every rank is ``get_total_norm`` of the whole
    gradients (``shard="none"``'s clipping), bit for bit, whatever the shards' edges cut:
    parameters whole in a shard, cut in two, spread over every shard, one per bucket."""
    import concurrent.futures

    from ringflow.engine.collective import GradientBuckets
    from ringflow.engine.sharding import ShardedOptimizer

    generator = torch.Generator().manual_seed(size)
    grads = {name: torch.randn(p.shape, generator=generator) * 10.0 ** torch.randint(
        -3, 3, (), generator=generator
    ) for name, p in _layers().named_parameters()}  # fmt: skip
    expected = torch.nn.utils.get_total_norm(list(grads.values()))
    ranks = _ThreadRanks(size)

    def norm_on(rank: int) -> torch.Tensor:
        model = _layers()
        collective = ranks.rank(rank)
        buckets = GradientBuckets(
            list(model.parameters()), collective, bucket_bytes=bucket_bytes, scatter=True
        )
        names = {id(p): name for name, p in model.named_parameters()}
        optimizer = ShardedOptimizer(torch.optim.Adam(model.parameters()), buckets, collective)
        for params, numel, mine in buckets.shards:
            whole = torch.cat([grads[names[id(p)]].view(-1) for p in params])
            whole = torch.cat([whole, whole.new_zeros(numel - whole.numel())])
            mine.copy_(whole[rank * mine.numel() : (rank + 1) * mine.numel()])
        return optimizer.whole_norm()

    with concurrent.futures.ThreadPoolExecutor(size) as pool:
        norms = list(pool.map(norm_on, range(size)))
    for norm in norms:
        assert torch.equal(norm, expected), (norm.item(), expected.item())


def _stepped_on(rank: int, collective, bucket_bytes: int):
    """A rank's Adam over :func:`_layers` sharded, after one step on gradients every rank
    draws alike."""
    from ringflow.engine.collective import GradientBuckets
    from ringflow.engine.sharding import ShardedOptimizer

    model = _layers()
    buckets = GradientBuckets(
        list(model.parameters()), collective, bucket_bytes=bucket_bytes, scatter=True
    )
    optimizer = ShardedOptimizer(torch.optim.Adam(model.parameters()), buckets, collective)
    generator = torch.Generator().manual_seed(7)
    for _, _, mine in buckets.shards:
        whole = torch.randn(mine.numel() * collective.world_size, generator=generator)
        mine.copy_(whole[rank * mine.numel() : (rank + 1) * mine.numel()])
    optimizer.attach_grads()
    optimizer.inner.step()
    return optimizer


@pytest.mark.parametrize(
    ("size", "bucket_bytes", "lost"),
    [(4, 300 * 4, [1]), (4, 10**6, [0]), (3, 1, [2]), (4, 300 * 4, [3, 1]), (4, 300 * 4, [1, 2])],
)
def test_a_commit_keeps_two_shards_and_the_members_left_assemble_the_whole_state(
    size, bucket_bytes, lost
):
    """Each rank's commit keeps its shard of every bucket's optimizer state and a copy of
    the next rank's: 2/size of the state, never the whole. With workers lost, the others and
    as many replacements (which kept nothing) assemble the whole state, bit for bit what
    ``state_dict`` gathers from all of them before; where a worker and the neighbour keeping
    its copy are both lost, every member fails in one line naming the lost shard."""
    import concurrent.futures

    from ringflow.engine.errors import EngineError
    from ringflow.engine.sharded_commit import assemble, handed

    ranks = _ThreadRanks(size)

    def commit_on(rank: int):
        optimizer = _stepped_on(rank, ranks.rank(rank), bucket_bytes)
        return optimizer.state_dict(), optimizer.commit_state(5, {})

    with concurrent.futures.ThreadPoolExecutor(size) as pool:
        done = list(pool.map(commit_on, range(size)))
    whole, commits = done[0][0], [commit for _, commit in done]
    for commit in commits:
        kept = sum(
            t.numel() for part in ("own", "replica") for ts in commit[part].values() for t in ts
        )
        assert kept * size == 2 * len(commit["own"]) * sum(commit["numels"])
    # The members after the loss: the survivors in their order, then the replacements.
    members = [commits[r] for r in range(size) if r not in lost]
    members += [handed(commits[0])] * len(lost)
    after = _ThreadRanks(len(members))

    def assemble_on(member: int):
        try:
            return assemble(members[member], after.rank(member), torch.device("cpu"))[0]
        except EngineError as err:
            return err

    with concurrent.futures.ThreadPoolExecutor(len(members)) as pool:
        assembled = list(pool.map(assemble_on, range(len(members))))
    uncovered = [r for r in lost if (r - 1) % size in lost]
    if uncovered:
        for err in assembled:
            assert isinstance(err, EngineError), err
            assert f"worker {min(uncovered)} (of {size})" in str(err)
            assert "\n" not in str(err)
        return
    for state in assembled:
        assert state["param_groups"] == whole["param_groups"]
        assert state["state"].keys() == whole["state"].keys()
        for index, entry in whole["state"].items():
            for key, value in entry.items():
                assert torch.equal(state["state"][index][key], value), (index, key)


def test_sharded_parameters_hold_memory_only_around_their_use_and_train_as_whole_ones():
    """ZeRO-3's units on one rank (the ring moves nothing; the hooks run as on many): each
    unit's buffer holds memory from the forward of its first layer to that of its last (the
    next unit's gather started meanwhile), none between steps, and an evaluation gathers and
    frees alike; Adam's steps end bit for bit where whole parameters' end. Whole weights
    written keep this rank's shard; gathered copies are the weights; released, the module
    carries no hook and its parameters have storage of their own."""
    from ringflow.engine.collective import GradientBuckets
    from ringflow.engine.collective.ring import RingCollective
    from ringflow.engine.sharded_parameters import ShardedParameters
    from ringflow.engine.sharding import ShardedOptimizer

    reference, model = _layers(), _layers()
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    ring = RingCollective(rank=0, world_size=1)
    buckets = GradientBuckets(
        list(model.parameters()), ring, bucket_bytes=300 * 4, scatter=True, keep_shards=True
    )
    weights = ShardedParameters(model, buckets, ring)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    sharded = ShardedOptimizer(optimizer, buckets, ring, parameters=weights)
    assert buckets.bucket_sizes == [340, 144]  # the last two layers, then the first

    def held() -> list[int]:
        return [flat.untyped_storage().nbytes() for flat in weights.flats]

    seen = []
    for layer in model:
        layer.register_forward_hook(lambda *_: seen.append(held()), prepend=True)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(5, 8, generator=generator)
        plain.zero_grad()
        reference(x).square().sum().backward()
        plain.step()
        optimizer.zero_grad()
        buckets.zero_()
        weights.begin()
        buckets.start()
        with weights.saving():
            loss = model(x).square().sum()
        assert held() == [0, 0]  # both freed after their forward, saved for backward
        loss.backward()
        buckets.finish()
        sharded.attach_grads()
        optimizer.step()
        sharded.gather()
        weights.end()
        assert held() == [0, 0]
    # Each layer's forward ran with: the first layer's unit and the next on its way, then
    # (ReLU, the other two layers) that next unit alone.
    assert seen[:4] == [[1360, 576], [1360, 0], [1360, 0], [1360, 0]]
    with torch.no_grad():
        weights.begin()
        assert torch.equal(model(x), reference(x))
        weights.end()
    assert held() == [0, 0]
    copies = weights.copies()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(copies[id(mine)], theirs)
    with weights.writing(), torch.no_grad():
        for param in model.parameters():
            param.fill_(0.5)
    assert all(torch.equal(shard, torch.full_like(shard, 0.5)) for shard in weights.shards)
    weights.release()
    sharded.release()
    assert all(not layer._forward_pre_hooks for layer in model)
    assert all(p.untyped_storage().nbytes() == p.numel() * 4 for p in model.parameters())


# ---------------------------------------------------------------------------- sharded checkpoints


class _Tied(torch.nn.Module):
    """An embedding tied to the output layer (one parameter, two names in ``state_dict``),
    a frozen bias (whole, not sharded) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 8)
        self.mid = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(24, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight
        self.mid.bias.requires_grad_(False)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))


class _Ranks:
    """Rank ``rank`` of ``world_size``, for building a rank's buckets, sharded parameters and
    sharded optimizer in one process: they run no collective until a step."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def empty(self, numel, dtype, device):
        return torch.zeros(numel, dtype=dtype, device=device)


def _trained_tied() -> tuple[_Tied, torch.optim.Optimizer]:
    """A :class:`_Tied` and its Adam after three steps on made-up gradients, its first
    group's learning rate changed since (a scheduler's)."""
    model = _Tied()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(3):
        for index, param in enumerate(model.parameters()):
            if param.requires_grad:
                param.grad = torch.linspace(-1, 1, param.numel()).view_as(param) * (step + index)
        optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.0123
    return model, optimizer


def _sharded_rank(model, rank: int, world_size: int, shard: str):
    """Rank ``rank``'s ``DataParallelStep`` of ``world_size`` over ``model`` (its pieces laid
    out as a worker lays them out), built without a worker or a ring."""
    from types import SimpleNamespace

    from ringflow.engine.collective import GradientBuckets
    from ringflow.engine.data_parallel import DataParallelStep
    from ringflow.engine.sharded_parameters import ShardedParameters
    from ringflow.engine.sharding import ShardedOptimizer

    ring = _Ranks(rank, world_size)
    trainable = [p for p in model.parameters() if p.requires_grad]
    buckets = GradientBuckets(
        trainable, ring, bucket_bytes=200 * 4, scatter=True, keep_shards=shard != "optimizer"
    )
    weights = ShardedParameters(model, buckets, ring) if shard == "parameters" else None
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    step = object.__new__(DataParallelStep)
    step.worker = SimpleNamespace(module=model, rank=rank, world_size=world_size)
    step.shards, step.weights = True, weights
    step.sharded = ShardedOptimizer(inner, buckets, ring, parameters=weights)
    return step


def _written_sharded(store, model, optimizer, world_size: int, shard: str, *, step: int = 3):
    """The state of ``model`` and ``optimizer`` as ``world_size`` sharded workers checkpoint
    it: each writes its shard, the manifest last."""
    from ringflow.storage.reshard import merge_sharded_optimizer_metadata

    records, metadatas = [], []
    for rank in range(world_size):
        worker = _sharded_rank(copy.deepcopy(model), rank, world_size, shard)
        worker.sharded.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        tensors, metadata = worker.own_training_state()
        records.append(store.write_shard("z", step=step, name=worker.shard, tensors=tensors))
        metadatas.append(metadata)
    merged = merge_sharded_optimizer_metadata(metadatas)
    pieces = merged.pop("pieces")
    return store.commit(
        "z", step=step, shards=records, metadata={"optimizer": merged, "pieces": pieces}
    )


@pytest.mark.parametrize("shard", MODES)
def test_a_sharded_checkpoint_is_every_workers_own_pieces_and_loads_on_any_number_bitwise(
    tmp_path, shard
):
    """Four sharded workers each write their shard alone, by name and element range: a
    parameter cut by a shard's edge is in pieces in two shards, a tied weight is written
    once (its other name recorded), what is not sharded is rank 0's. Assembled whole, it is
    the model's and the optimizer's state bit for bit; two sharded workers (ZeRO-1 and
    ZeRO-3) each load their pieces from the shards that hold them, as each would take them
    from the whole state; a missing shard is named."""
    import copy as _copy

    from ringflow.storage import CheckpointError, CheckpointStore, load_whole, training_state

    store = CheckpointStore(str(tmp_path / "store"))
    model, optimizer = _trained_tied()
    checkpoint = _written_sharded(store, model, optimizer, 4, shard)
    assert sorted(checkpoint.shards) == [f"zero-0000{r}" for r in range(4)]
    from ringflow.storage.reshard import split_piece_key

    held = [set(record.tensors) for record in checkpoint.shards.values()]
    shards_of: dict[str, set[int]] = {}
    for rank, names in enumerate(held):
        for name in names:
            key, start, _ = split_piece_key(name)
            if start is not None:
                shards_of.setdefault(key, set()).add(rank)
    assert any(len(ranks) > 1 for key, ranks in shards_of.items() if key.startswith("model/"))
    assert any(len(ranks) > 1 for key, ranks in shards_of.items() if key.endswith("/exp_avg"))
    steps = [n for names in held for n in names if n.endswith("/step")]
    assert len(steps) == len(set(steps))  # a step count whole, once
    assert "model/scale" in held[0]
    assert "model/mid.bias" in held[0]
    assert not any("scale" in n or "mid.bias" in n for names in held[1:] for n in names)
    assert checkpoint.metadata["pieces"]["aliases"] == {"head.weight": "embed.weight"}
    assert not any(n.startswith("model/head.weight") for names in held for n in names)

    expected, _ = training_state(model, optimizer)
    whole = load_whole(store, checkpoint)
    assert whole.keys() == expected.keys()
    for key, tensor in expected.items():
        assert whole[key].dtype == tensor.dtype, key
        assert torch.equal(whole[key], tensor), key

    for target in ("optimizer", "parameters"):
        for rank in range(2):
            loaded = _sharded_rank(_Tied(), rank, 2, target)  # another init, overwritten
            with torch.no_grad():
                loaded.worker.module.scale.zero_()
            assert loaded.restore_own(store, checkpoint)
            wanted = _sharded_rank(_copy.deepcopy(model), rank, 2, target)
            wanted.sharded.load_state_dict(_copy.deepcopy(optimizer.state_dict()))
            _assert_same_optimizer_state(
                loaded.sharded.inner.state_dict(), wanted.sharded.inner.state_dict()
            )
            assert loaded.sharded.inner.param_groups[0]["lr"] == 0.0123
            if target == "parameters":
                for mine, theirs in zip(loaded.weights.shards, wanted.weights.shards, strict=True):
                    assert torch.equal(mine, theirs)
                assert torch.equal(loaded.worker.module.scale, model.scale)
            else:
                for name, tensor in model.state_dict().items():
                    assert torch.equal(loaded.worker.module.state_dict()[name], tensor), name

    records = [r for name, r in checkpoint.shards.items() if name != "zero-00002"]
    partial = store.commit("z", step=3, shards=records, metadata=checkpoint.metadata)
    with pytest.raises(CheckpointError, match="cover"):
        load_whole(store, partial)


@pytest.mark.ray
@pytest.mark.parametrize(
    ("shard", "then"), [("parameters", "gradients"), ("optimizer", "parameters")]
)
def test_four_sharded_workers_checkpoint_resumes_on_two_sharded_and_one_unsharded_bitwise(
    ray_session, digits, tmp_path, shard, then
):
    """Four sharded workers checkpoint their shards (``zero-0000{0..3}``, no state gathered
    anywhere), whose weights assembled are the run's. Resumed on two workers under another
    shard mode (``then``) and on one worker unsharded, each run ends bit for bit where the
    same run resumed from the same state in the format of ``shard="none"`` ends (the one
    whole shard every worker reads; the same membership history: four workers, then two or
    one). No uninterrupted run goes from four workers to two: a sharded run keeps its
    workers (``min_workers`` below ``workers`` is refused), and a run on fewer workers sums
    the gradients in another order, so only the resumed runs compare bit for bit; that one
    ended where it started from is ``test_a_sharded_run_resumes_bitwise...``'s."""
    import shutil

    from ringflow.storage import REPLICATED, CheckpointStore, load_whole

    every = {"bucket_mb": BUCKET_MB, "checkpoint_every": 10, "cpus_per_worker": 0.5}
    pieces = tmp_path / "pieces"
    four, _ = _fit(
        digits,
        tmp_path,
        "four",
        store_url=str(pieces),
        run_key="r",
        workers=4,
        shard=shard,
        epochs=2,
        **every,
    )
    store = CheckpointStore(str(pieces))
    checkpoint = store.checkpoints("r")[-1]
    assert checkpoint.step == 46
    assert sorted(checkpoint.shards) == [f"zero-0000{r}" for r in range(4)]
    whole = load_whole(store, checkpoint)
    for name, tensor in four.state_dict.items():
        assert torch.equal(whole[f"model/{name}"], tensor), name
    # The same state as shard="none" writes it: one shard, every tensor whole.
    replicated = tmp_path / "whole"
    CheckpointStore(str(replicated)).save(
        "r",
        step=checkpoint.step,
        shards={REPLICATED: whole},
        metadata={k: v for k, v in checkpoint.metadata.items() if k != "pieces"},
        metrics=checkpoint.metrics,
    )
    plain, _ = _fit(digits, tmp_path, "plain", epochs=3, bucket_mb=BUCKET_MB)
    for workers, mode in ((2, then), (1, "none")):
        ends = []
        for source in (pieces, replicated):
            copied = tmp_path / f"{source.name}-{workers}"
            shutil.copytree(source, copied)
            resumed, _ = _fit(
                digits,
                tmp_path,
                copied.name,
                store_url=str(copied),
                run_key="r",
                workers=workers,
                shard=mode,
                epochs=3,
                **every,
            )
            assert resumed.resumed_from == 46
            ends.append(resumed.state_dict)
        from_pieces, from_whole = ends
        assert from_pieces.keys() == from_whole.keys()
        for name, tensor in from_whole.items():
            assert torch.equal(from_pieces[name], tensor), (workers, mode, name)
        # Where two unsharded workers end, but for the order of the sums: the epoch started
        # from the checkpoint (from the initial weights it ends elsewhere).
        assert relative_difference(from_pieces, plain.state_dict) < 1e-5


@pytest.mark.ray
def test_a_gpt_whose_head_reads_the_embedding_trains_under_sharded_parameters(
    ray_session, tmp_path
):
    """The GPT's head is its token embedding's weight, read in the GPT's own forward after
    the embedding's forward ended (``F.linear(x, self.wte.weight)``, as nanoGPT ties them):
    under ZeRO-3 the embedding's unit is kept to the end of its parent's forward, and
    training ends within 1e-6 of ``shard="none"``."""
    from ringflow.engine import DatasetData
    from ringflow.models.gpt import GPTModule, TokenWindows, stdlib_tokens

    tokens = stdlib_tokens(max_tokens=12 * 8 * 32 + 1)
    data = DatasetData(train=TokenWindows(tokens, 32))
    hparams = {"preset": "tiny", "overrides": {"block_size": 32}, "lr": 1e-3, "warmup_steps": 2}
    results = {}
    for mode in ("none", "parameters"):
        results[mode] = fit(
            GPTModule,
            hparams=hparams,
            data=data,
            config=TrainConfig(
                workers=2, epochs=1, batch_size=8, seed=0, shard=mode, bucket_mb=0.05
            ),
            checkpoint_uri=str(tmp_path / mode),
        )
    initial = GPTModule(**hparams).state_dict()
    assert relative_difference(results["none"].state_dict, initial) > 1e-3
    difference = relative_difference(results["parameters"].state_dict, results["none"].state_dict)
    assert difference < 1e-6, difference


class _DiesWithoutReplacement(_KillsItself):
    """:class:`_KillsItself` whose ``mark`` keeps any replacement from starting: the
    membership history is the same whatever the timing (the driver builds the module too,
    after training: it is let through)."""

    def __init__(self, dies_at: int = -1, mark: str = "", **kwargs) -> None:
        from tests.test_scaling_rules import _in_a_ray_actor

        if mark and Path(mark).exists() and _in_a_ray_actor():
            raise RuntimeError("no replacement in this test")
        super().__init__(dies_at=dies_at, mark=mark, **kwargs)


class _PacedKillsItself(_KillsItself):
    """:class:`_KillsItself` whose steps, while fewer than four train, are slow enough for a
    replacement to start and join before the run ends (up to 90 s)."""

    def training_step(self, batch, batch_idx):
        if self.trainer.world_size < 4:
            time.sleep(1.0)
        return super().training_step(batch, batch_idx)


def _elastic_fit(digits, tmp_path, module, hparams, **config):
    """Four workers, three of them enough (``min_workers``); no store: nothing can be read
    back from storage. A killed worker's peers see its connections close at once; the
    deadline, for a peer that stops answering, is generous: four workers share two cores."""
    record = tmp_path / "bytes-elastic"
    record.mkdir()
    settings = {"workers": 4, "min_workers": 3, "batch_size": 64, "seed": 3, **config}
    return fit(
        module,
        hparams={**HPARAMS, **hparams, "record": str(record)},
        data=digits,
        config=TrainConfig(collective_timeout_s=KILLED_PEER_DEADLINE_S, **settings),
        checkpoint_uri=str(tmp_path / "elastic"),
    )


@pytest.mark.ray
@pytest.mark.parametrize("shard", ["parameters", "gradients"])
def test_one_of_four_sharded_workers_killed_leaves_three_that_go_on_from_memory_bitwise(
    ray_session, digits, tmp_path, shard
):
    """Rank 1 of four SIGKILLs itself as epoch 1 starts, and no replacement can start. The
    three survivors roll back to the in-memory commit of step 23 (the lost worker's shards
    live on only there), shard it again among themselves and go on; no store is given, so
    nothing is read from storage. They end bit for bit (weights, and the optimizer state)
    where the same membership history ends by way of storage: four workers checkpointing
    epoch 0, then three resuming from the checkpoint's four shards."""
    every = {"bucket_mb": BUCKET_MB, "cpus_per_worker": 0.5, "shard": shard}
    mark = tmp_path / "killed"
    elastic = _elastic_fit(
        digits,
        tmp_path,
        _DiesWithoutReplacement,
        {"dies_at": 23, "mark": str(mark)},
        epochs=2,
        **every,
    )
    assert mark.exists()
    assert [(e.kind, e.step, e.workers) for e in elastic.events] == [
        ("lost", 23, 3),
        ("rollback", 23, 3),
        ("recovered", 24, 3),
    ]
    store = {"store_url": str(tmp_path / "store"), "run_key": "r"}
    _fit(digits, tmp_path, "four", workers=4, epochs=1, **store, **every)
    resumed, _ = _fit(digits, tmp_path, "three", workers=3, epochs=2, **store, **every)
    assert resumed.resumed_from == 23
    assert elastic.state_dict.keys() == resumed.state_dict.keys()
    for name, tensor in resumed.state_dict.items():
        assert torch.equal(elastic.state_dict[name], tensor), name
    expected = _optimizer_states(tmp_path, "r", 3)  # the resumed run's (its run key's)
    for got, want in zip(_optimizer_states(tmp_path, "elastic", 3), expected, strict=True):
        _assert_same_optimizer_state(got, want)


@pytest.mark.ray
def test_a_replacement_takes_a_shard_back_when_it_joins_and_the_run_ends_as_four_workers_do(
    ray_session, digits, tmp_path
):
    """Under ZeRO-3, rank 1 of four dies as epoch 1 starts; the three survivors go on from
    the commit, a replacement joins at a later commit, takes its shard of the commit's state
    and the four end where four workers that lost nobody end (but for the order of the
    sums while three trained)."""
    elastic = _elastic_fit(
        digits,
        tmp_path,
        _PacedKillsItself,
        {"dies_at": 23, "mark": str(tmp_path / "killed")},
        epochs=5,
        shard="parameters",
        bucket_mb=BUCKET_MB,
        cpus_per_worker=0.5,
    )
    kinds = [(e.kind, e.workers) for e in elastic.events]
    assert kinds == [("lost", 3), ("rollback", 3), ("recovered", 3), ("joined", 4)], kinds
    steps = [int((tmp_path / "bytes-elastic" / f"steps-{r}").read_text()) for r in range(4)]
    assert steps == [5 * 23] * 4  # every rank, the replacement too, ended at the last step
    whole, _ = _fit(
        digits, tmp_path, "whole", workers=4, epochs=5, bucket_mb=BUCKET_MB, cpus_per_worker=0.5
    )
    assert relative_difference(elastic.state_dict, whole.state_dict) < 1e-6
