"""Pipeline parallelism in one process: schedules, partitioning, and stages in threads that
talk over real gloo point-to-point on loopback, checked against the unsplit model."""

from __future__ import annotations

import concurrent.futures
import datetime as dt

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import nn
from torch.nn import functional as F

from ringflow.engine import CollectiveTimeoutError, TrainConfig, fit
from ringflow.engine.pipeline import (
    Action,
    MicroBatches,
    PipelineConfig,
    PipelineStage,
    StageLink,
    TensorData,
    balanced_bounds,
    check_pipeline,
    max_in_flight,
    partition_model,
    run_schedule,
    stage_actions,
)
from ringflow.storage.reshard import load_pipeline_stage, load_training_state, pipeline_shards
from ringflow.storage.store import CheckpointStore
from tests.support.fitting import relative_difference
from tests.support.net import free_port

FEATURES, CLASSES = 8, 3


class ToyNet(nn.Module):
    """A layer sequence with parameters in nested containers (names like ``blocks.1.0.weight``)."""

    def __init__(self, *, width: int = 16, depth: int = 4, lr: float = 0.01, dropout: float = 0.0):
        super().__init__()
        self.lr = lr
        self.inp = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(dropout))
            for _ in range(depth)
        )
        self.out = nn.Linear(width, CLASSES)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.inp, *self.blocks, self.out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def pipeline_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def toy_data(samples: int = 61, seed: int = 1) -> TensorData:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (samples,), generator=g)
    return TensorData(splits={"train": (x, y), "validation": (x[:20], y[:20])})


def stage_step(
    stages: int, *, schedule: str, micro_batches: int, samples: int = 13, recompute=False
) -> tuple[dict[str, torch.Tensor], list[int], torch.Tensor, torch.Tensor]:
    """One training step of a ``stages``-stage ToyNet in threads over gloo.

    Returns:
        Every parameter's gradient by full name, each stage's peak of micro-batches in
        flight, and the batch.
    """
    x, y = toy_data(samples).splits["train"]
    torch.manual_seed(0)
    partition = partition_model(ToyNet(), PipelineConfig(stages=stages, balance="params"))
    port = free_port()
    master = tcp_store(port, is_master=True)
    parts = torch.tensor_split(torch.arange(samples), micro_batches)

    built = []
    for s in range(stages):  # here, not in the threads: they would share torch's generator
        torch.manual_seed(0)
        built.append(
            PipelineStage(
                ToyNet(),
                partition=partition,
                stage=s,
                example=x[:1],
                loss_fn=lambda out, t: F.cross_entropy(out, t),
                recompute=recompute,
            )
        )

    def run(s: int) -> tuple[dict[str, torch.Tensor], int]:
        stage = built[s]
        link = StageLink(
            store=tcp_store(port), stage=s, stages=stages, timeout_s=10, connect_timeout_s=10
        )
        micro = MicroBatches(
            sizes=tuple(len(p) for p in parts),
            inputs=[x[p] for p in parts],
            targets=[y[p] for p in parts],
            weights=tuple(len(p) / samples for p in parts),
        )
        actions = stage_actions(schedule, stage=s, stages=stages, micro_batches=len(parts))
        run_schedule(stage, actions, link=link, micro=micro)
        grads = {n: p.grad.clone() for n, p in stage.module.named_parameters()}
        return grads, stage.peak_in_flight

    with concurrent.futures.ThreadPoolExecutor(stages) as pool:
        results = list(pool.map(run, range(stages)))
    del master
    grads = {name: g for part, _ in results for name, g in part.items()}
    return grads, [peak for _, peak in results], x, y


def tcp_store(port: int, *, is_master: bool = False) -> dist.Store:
    """One store client per stage: a client must not be shared between threads."""
    return dist.TCPStore("127.0.0.1", port, is_master=is_master, timeout=dt.timedelta(10))


def unsplit_gradients(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = ToyNet()
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro"), [(2, 1), (2, 4), (3, 2), (3, 7), (4, 4)])
def test_every_schedule_runs_each_micro_batch_forward_then_backward_once(name, stages, micro):
    for s in range(stages):
        actions = stage_actions(name, stage=s, stages=stages, micro_batches=micro)
        forwards = [a.micro for a in actions if a.kind == "F"]
        backwards = [a.micro for a in actions if a.kind == "B"]
        assert forwards == list(range(micro))
        assert backwards == list(range(micro))
        for i in range(micro):
            assert actions.index(Action("F", i)) < actions.index(Action("B", i))


def test_neighbours_see_transfers_in_the_same_order():
    # What stage s sends forward, stage s+1 receives in the same order, and likewise backward.
    for name in ("gpipe", "1f1b"):
        for stages, micro in [(2, 3), (3, 8), (4, 2)]:
            orders = [
                stage_actions(name, stage=s, stages=stages, micro_batches=micro)
                for s in range(stages)
            ]
            for s in range(stages - 1):
                assert [a for a in orders[s] if a.kind == "F"] == [
                    a for a in orders[s + 1] if a.kind == "F"
                ]
                assert [a for a in orders[s + 1] if a.kind == "B"] == [
                    a for a in orders[s] if a.kind == "B"
                ]


@pytest.mark.parametrize(("stages", "micro"), [(2, 8), (3, 8), (4, 2)])
def test_1f1b_keeps_at_most_p_in_flight_and_gpipe_keeps_m(stages, micro):
    for s in range(stages):
        one_f = stage_actions("1f1b", stage=s, stages=stages, micro_batches=micro)
        gpipe = stage_actions("gpipe", stage=s, stages=stages, micro_batches=micro)
        assert max_in_flight(one_f) == min(stages - s, micro)
        assert max_in_flight(gpipe) == micro


def test_unknown_schedule_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"schedule must be one of \['1f1b', 'gpipe'\]"):
        PipelineConfig(schedule="zb")


# ---------------------------------------------------------------------------- partitioning


def test_balanced_bounds_minimise_the_largest_stage():
    assert balanced_bounds([1, 1, 1, 1], 2) == (0, 2, 4)
    assert balanced_bounds([5, 1, 1, 1, 1, 1], 2) == (0, 1, 6)
    assert balanced_bounds([1, 2, 3, 4, 5], 3) == (0, 3, 4, 5)
    assert balanced_bounds([3, 3, 3], 3) == (0, 1, 2, 3)


def test_params_balance_gives_each_stage_a_share_of_the_layers():
    partition = partition_model(ToyNet(), PipelineConfig(stages=3, balance="params"))
    assert partition.names == ("inp", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "out")
    assert partition.stages == 3
    assert all(partition.layers_of(s) for s in range(3))


def test_time_balance_profiles_on_an_example():
    config = PipelineConfig(stages=2, balance="time")
    partition = partition_model(ToyNet(), config, example=torch.randn(4, FEATURES))
    assert partition.bounds[::2] == (0, 6)
    assert 0 < partition.bounds[1] < 6


def test_explicit_split_points_by_name_or_index():
    by_name = partition_model(ToyNet(), PipelineConfig(stages=3, balance=("blocks.1", "out")))
    by_index = partition_model(ToyNet(), PipelineConfig(stages=3, balance=(2, 5)))
    assert by_name.bounds == by_index.bounds == (0, 2, 5, 6)


def test_split_points_the_module_declares():
    class Marked(ToyNet):
        pipeline_split_points = ("blocks.2",)

    partition = partition_model(Marked(), PipelineConfig(stages=2, balance="module"))
    assert partition.layers_of(1) == ("blocks.2", "blocks.3", "out")


@pytest.mark.parametrize(
    ("model", "config", "message"),
    [
        (ToyNet(depth=1), PipelineConfig(stages=4), r"stages \(4\) exceeds the model's 3 layers"),
        (nn.Linear(2, 2), PipelineConfig(stages=2), "is not a layer sequence"),
        (ToyNet(), PipelineConfig(stages=3, balance=(3, 2)), "must be increasing"),
        (ToyNet(), PipelineConfig(stages=2, balance=("nope",)), "'nope' is not a layer"),
        (ToyNet(), PipelineConfig(stages=2, balance="module"), "declares no pipeline_split"),
    ],
)
def test_bad_partitions_are_refused(model, config, message):
    with pytest.raises(ValueError, match=message):
        partition_model(model, config)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stages": 0}, "stages"),
        ({"micro_batches": 0}, "micro_batches"),
        ({"balance": "weights"}, "balance"),
        ({"stages": 3, "balance": ("out",)}, "balance has 1 split points"),
        ({"recompute": "yes"}, "recompute"),
    ],
)
def test_bad_pipeline_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PipelineConfig(**kwargs)


def test_global_batch_too_small_for_the_micro_batches_is_refused_before_workers_start():
    with pytest.raises(ValueError, match=r"batch_size \(6\) is smaller than micro_batches \(4\)"):
        check_pipeline(
            ToyNet,
            hparams={},
            data=toy_data(),
            config=TrainConfig(workers=2, batch_size=6),
            pipeline=PipelineConfig(stages=2, micro_batches=4),
        )


def test_a_module_without_a_loss_is_refused_before_workers_start():
    with pytest.raises(ValueError, match="must define pipeline_loss"):
        check_pipeline(
            nn.Sequential,
            hparams={},
            data=toy_data(),
            config=TrainConfig(workers=1, batch_size=8),
            pipeline=PipelineConfig(stages=1),
        )


# ---------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro"), [(2, 1), (2, 4), (3, 2), (3, 5)])
def test_gradients_match_the_unsplit_model(schedule, stages, micro):
    # 13 samples: micro-batches of uneven size (13 = 3+3+3+2+2 for 5), and M < P cases.
    grads, _, x, y = stage_step(stages, schedule=schedule, micro_batches=micro)
    assert relative_difference(grads, unsplit_gradients(x, y)) < 1e-5


def test_recomputed_activations_give_the_same_gradients():
    grads, _, x, y = stage_step(3, schedule="1f1b", micro_batches=4, recompute=True)
    assert relative_difference(grads, unsplit_gradients(x, y)) < 1e-5


@pytest.mark.parametrize(("stages", "micro"), [(3, 8), (2, 6)])
def test_1f1b_holds_at_most_p_micro_batches_of_activations_where_gpipe_holds_m(stages, micro):
    _, one_f, _, _ = stage_step(stages, schedule="1f1b", micro_batches=micro, samples=16)
    _, gpipe, _, _ = stage_step(stages, schedule="gpipe", micro_batches=micro, samples=16)
    assert one_f == [stages - s for s in range(stages)]
    assert gpipe == [micro] * stages


def unsplit_training(data: TensorData, config: TrainConfig) -> dict[str, torch.Tensor]:
    """What ``fit`` on one worker computes: Adam on the mean loss of each global batch."""
    torch.manual_seed(config.seed)
    model = ToyNet()
    optimizer = model.configure_optimizers()
    x, y = data.splits["train"]
    for epoch in range(config.epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(config.seed + epoch))
        for start in range(0, len(y), config.batch_size):
            batch = order[start : start + config.batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("stages", "schedule", "micro"), [(2, "gpipe", 3), (3, "1f1b", 4)])
def test_a_pipeline_fit_in_process_ends_with_the_unsplit_weights(stages, schedule, micro, tmp_path):
    data = toy_data()  # 61 samples in batches of 16: the last global batch has 13
    config = TrainConfig(workers=1, epochs=2, batch_size=16, seed=3)
    result = fit(
        ToyNet,
        hparams={},
        data=data,
        config=config,
        pipeline=PipelineConfig(stages=stages, micro_batches=micro, schedule=schedule),
        checkpoint_uri=str(tmp_path / "model"),
        in_process=True,
    )
    assert relative_difference(result.state_dict, unsplit_training(data, config)) < 1e-5
    assert [sorted(h.metrics) for h in result.history] == [["train_loss", "val_loss"]] * 2


# ---------------------------------------------------------------------------- deadlines


def test_a_silent_neighbour_raises_a_timeout_naming_it():
    port = free_port()
    master = tcp_store(port, is_master=True)
    x = torch.randn(4, FEATURES)
    partition = partition_model(ToyNet(), PipelineConfig(stages=2))

    def first_stage() -> None:
        stage = PipelineStage(ToyNet(), partition=partition, stage=0, example=x)
        link = StageLink(
            store=tcp_store(port), stage=0, stages=2, timeout_s=1.0, connect_timeout_s=10
        )
        micro = MicroBatches(sizes=(4,), inputs=[x], weights=(1.0,))
        run_schedule(
            stage, stage_actions("1f1b", stage=0, stages=2, micro_batches=1), link=link, micro=micro
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(first_stage)
        # The second stage joins and then never answers (hung, or busy elsewhere).
        silent = pool.submit(
            StageLink,
            store=tcp_store(port),
            stage=1,
            stages=2,
            timeout_s=1.0,
            connect_timeout_s=10,
        )
        with pytest.raises(CollectiveTimeoutError) as caught:
            running.result(timeout=30)
        silent.result()
    del master
    assert caught.value.peer == 1
    assert "collective_timeout_s" in str(caught.value)


# ---------------------------------------------------------------------------- checkpoints


def test_stage_checkpoints_load_bitwise_into_other_stage_counts(tmp_path):
    x, y = toy_data(8).splits["train"]
    saved = []
    for s in range(2):  # train each stage of a 2-stage pipeline one step, then save it
        torch.manual_seed(0)
        stage = PipelineStage(
            ToyNet(),
            partition=partition_model(ToyNet(), PipelineConfig(stages=2)),
            stage=s,
            example=x,
            loss_fn=lambda out, t: F.cross_entropy(out, t),
        )
        optimizer = stage.module.configure_optimizers()
        for p in stage.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        saved.append(training_state_of(stage.module, optimizer))
    store = CheckpointStore(str(tmp_path / "ckpt"))
    committed = store.save(
        "run",
        step=1,
        shards=pipeline_shards([t for t, _ in saved]),
        metadata={"optim": merge([m for _, m in saved])},
    )
    whole = {k: v for tensors, _ in saved for k, v in tensors.items()}
    for stages in (1, 3):
        loaded = {}
        for s in range(stages):
            torch.manual_seed(123)  # other weights: loading must replace every one
            stage = PipelineStage(
                ToyNet(),
                partition=partition_model(ToyNet(), PipelineConfig(stages=stages)),
                stage=s,
                example=x,
                loss_fn=lambda out, t: F.cross_entropy(out, t),
            )
            optimizer = stage.module.configure_optimizers()
            tensors = load_pipeline_stage(store, committed, names=stage.module.state_dict())
            load_training_state(stage.module, optimizer, tensors, committed.metadata["optim"])
            loaded.update(training_state_of(stage.module, optimizer)[0])
        assert loaded.keys() == whole.keys()
        assert all(torch.equal(loaded[k], whole[k]) for k in whole)


def training_state_of(module, optimizer):
    from ringflow.storage.reshard import training_state

    tensors, metadata = training_state(module, optimizer)
    return {k: v.clone() for k, v in tensors.items()}, metadata


def merge(metadatas):
    from ringflow.storage.reshard import merge_optimizer_metadata

    return merge_optimizer_metadata(metadatas)


def test_a_pipeline_run_resumes_after_its_last_committed_epoch_bit_for_bit(tmp_path):
    """``fit`` with a pipeline commits every stage's weights and optimizer state at each epoch end;
    a run started again under the same run key (as a retried flow run is) goes on from there
    and ends exactly where an uninterrupted run ends. Another run key starts afresh, and a
    checkpoint of another configuration is refused."""
    data = toy_data()
    layout = PipelineConfig(stages=2, micro_batches=3, schedule="1f1b")

    def run(epochs: int, store: str, run_key: str, seed: int = 3):
        return fit(
            ToyNet,
            hparams={},
            data=data,
            config=TrainConfig(workers=1, epochs=epochs, batch_size=16, seed=seed),
            pipeline=layout,
            checkpoint_uri=str(tmp_path / f"model-{run_key}-{epochs}"),
            in_process=True,
            store_url=store,
            run_key=run_key,
        )

    whole = run(3, str(tmp_path / "a"), "whole")
    assert whole.resumed_from is None
    first = run(2, str(tmp_path / "b"), "cut")  # the first attempt, preempted after 2 epochs
    assert first.resumed_from is None
    again = run(3, str(tmp_path / "b"), "cut")
    assert again.resumed_from == 2 * 4  # 2 epochs of 4 steps (61 samples, 16 a batch)
    assert [e.kind for e in again.events] == ["resumed"]
    assert [h.epoch for h in again.history] == [0, 1, 2]
    assert again.history[:2] == first.history
    assert set(again.state_dict) == set(whole.state_dict)
    for name, tensor in whole.state_dict.items():
        assert torch.equal(again.state_dict[name], tensor), name
    with pytest.raises(ValueError, match="use a new run key"):
        run(3, str(tmp_path / "b"), "cut", seed=4)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "micro"), [(2, 4), (2, 16), (3, 5), (4, 2)])
def test_the_bench_replay_of_constant_actions_is_the_theoretical_bubble(schedule, stages, micro):
    """``bench.pipeline.replay`` runs the stages' actions with free transfers: with equal,
    constant forward and backward times its bubble is (P-1)/(M+P-1) on every stage."""
    from bench.pipeline import replay

    actions = [
        tuple(
            (repr(a), 1.0 if a.kind == "F" else 2.0)
            for a in stage_actions(schedule, stage=s, stages=stages, micro_batches=micro)
        )
        for s in range(stages)
    ]
    theory = (stages - 1) / (micro + stages - 1)
    assert replay(actions) == pytest.approx([theory] * stages)


def test_the_bench_replay_turns_one_slow_action_into_idle_time_on_the_neighbour():
    from bench.pipeline import replay

    actions = [
        [(repr(a), 1.0) for a in stage_actions("1f1b", stage=s, stages=2, micro_batches=8)]
        for s in range(2)
    ]
    actions[1][5] = (actions[1][5][0], 3.0)  # one action of stage 1 takes 3x as long
    bubbles = replay([tuple(a) for a in actions])
    assert bubbles[0] > 1 / 9 + 0.05  # stage 0 waited for it
    swapped = [list(a) for a in actions]
    swapped[0][0], swapped[0][2] = swapped[0][2], swapped[0][0]  # B0 before F0: deadlock
    with pytest.raises(ValueError, match="not a valid schedule"):
        replay([tuple(a) for a in swapped])


class LightningToyNet(ToyNet, LightningModule):
    """ToyNet as a LightningModule: the same layers train data-parallel or as a pipeline."""

    def pipeline_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float(), target)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.pipeline_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


EVERY_OPTION = {
    "accumulate_grad_batches": 2,
    "gradient_clip_val": 0.05,  # below the gradients' norm: every step is clipped
    "gradient_clip_algorithm": "norm",
}


def _fit_toy(
    tmp_path, name: str, *, pipeline: PipelineConfig | None = None, init_from=None, **config
):
    settings = {"workers": 1, "epochs": 3, "batch_size": 24, "seed": 2, **EVERY_OPTION, **config}
    return fit(
        LightningToyNet,
        hparams={},
        data=toy_data(samples=96),
        config=TrainConfig(**settings),
        checkpoint_uri=str(tmp_path / name),
        pipeline=pipeline,
        init_from=init_from,
        in_process=settings["workers"] == 1,
    )


def test_a_pipeline_accumulates_and_clips_by_the_whole_models_norm_as_one_worker_does(tmp_path):
    """Two stages of three micro-batches each, stepping every second batch and clipping by
    the norm of the whole gradient (the stages sum their squared norms), end where one
    data-parallel worker does: the options mean the same under both layouts."""
    staged = PipelineConfig(stages=2, micro_batches=3)
    whole = _fit_toy(tmp_path, "whole")
    piped = _fit_toy(tmp_path, "piped", pipeline=staged)
    assert relative_difference(piped.state_dict, whole.state_dict) < 1e-6
    # Each option changes the result: clipping each stage by its own norm would not match.
    unclipped = _fit_toy(tmp_path, "unclipped", gradient_clip_val=None)
    every_batch = _fit_toy(tmp_path, "every-batch", accumulate_grad_batches=1)
    assert relative_difference(unclipped.state_dict, whole.state_dict) > 1e-2
    assert relative_difference(every_batch.state_dict, whole.state_dict) > 1e-2


def test_a_pipeline_in_bf16_mixed_runs_its_stages_under_autocast(tmp_path):
    """bf16-mixed: the stages run under autocast and send bfloat16 activations, ending where
    one worker does for the same batches (one micro-batch: autocast rounds each
    micro-batch's weight gradient to bfloat16, so M micro-batches match a data-parallel run
    of the same parts, not of the whole batch; docs/pipeline.md)."""
    whole = _fit_toy(tmp_path, "whole", precision="bf16-mixed")
    piped = _fit_toy(
        tmp_path,
        "piped",
        precision="bf16-mixed",
        pipeline=PipelineConfig(stages=2, micro_batches=1),
    )
    fp32 = _fit_toy(tmp_path, "fp32")
    assert relative_difference(piped.state_dict, whole.state_dict) < 1e-6
    assert relative_difference(piped.state_dict, fp32.state_dict) > 1e-5  # bf16 did run


def test_a_pipeline_warm_starts_from_a_committed_model_as_one_worker_does(tmp_path):
    """Each stage takes its layers' weights of a committed model (``init_from``)."""
    trained = _fit_toy(tmp_path, "trained", epochs=1)
    whole = _fit_toy(tmp_path, "whole", init_from=trained.checkpoint)
    piped = _fit_toy(
        tmp_path, "piped", init_from=trained.checkpoint, pipeline=PipelineConfig(stages=3)
    )
    fresh = _fit_toy(tmp_path, "fresh")
    assert relative_difference(piped.state_dict, whole.state_dict) < 1e-6
    assert relative_difference(fresh.state_dict, whole.state_dict) > 1e-2


@pytest.mark.parametrize("others_overflowed", [False, True])
def test_a_stage_skips_its_16_mixed_step_when_another_stages_gradients_overflowed(
    others_overflowed,
):
    """The stages of one model step together: a stage whose own gradients are finite skips
    the step, and halves its scale, where another stage's overflowed (``across`` sums the
    stages' overflow counts), so every stage keeps one scale."""
    from ringflow.engine.module import Optimization, Precision

    module = LightningToyNet()
    precision = Precision("16-mixed", torch.device("cpu"))
    optimization = Optimization(module, precision)
    precision.backward(module(torch.ones(2, FEATURES)).sum())
    before = {k: v.clone() for k, v in module.state_dict().items()}
    scale = precision.scaler.get_scale()
    optimization.step(
        0,
        last=False,
        clip_val=None,
        clip_algorithm="norm",
        across=lambda found: found + float(others_overflowed),
    )
    unchanged = all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    assert unchanged == others_overflowed
    assert precision.scaler.get_scale() == (scale / 2 if others_overflowed else scale)


def test_a_pipeline_commits_each_checkpoint_its_stages_wrote_mid_epoch_too(tmp_path):
    """Each stage writes its own shard in the background; the manifest of a checkpoint follows
    once every stage's is written: every checkpoint ``checkpoint_every`` asks for, mid-epoch
    ones included, is committed with one shard per stage, and a run started again resumes
    from the latest."""
    from ringflow.storage.reshard import stage_shard
    from ringflow.storage.store import CheckpointStore, RetentionPolicy

    data = toy_data()
    layout = PipelineConfig(stages=2, micro_batches=3, schedule="1f1b")
    store_url = str(tmp_path / "store")

    def run(epochs: int, name: str):
        return fit(
            ToyNet,
            hparams={},
            data=data,
            config=TrainConfig(workers=1, epochs=epochs, batch_size=16, seed=3, checkpoint_every=2),
            pipeline=layout,
            checkpoint_uri=str(tmp_path / name),
            in_process=True,
            store_url=store_url,
            run_key="staged",
        )

    run(1, "first")  # 4 steps: checkpoints at 2 and 4
    store = CheckpointStore(store_url, retention=RetentionPolicy(keep_last=10))
    committed = store.checkpoints("staged")
    assert [c.step for c in committed] == [2, 4]
    for checkpoint in committed:
        assert sorted(checkpoint.shards) == [stage_shard(0), stage_shard(1)]
        assert checkpoint.metadata["stages"] == 2
    again = run(2, "again")
    assert again.resumed_from == 4


def test_a_stages_written_shard_is_read_again_while_another_stage_still_writes():
    """The driver asks every stage whether its shard is written, and asks again while one is
    still writing: a stage that answered ``written`` must say so again, not ``none`` (which
    reads as a stage replaced, and drops the checkpoint)."""
    from ringflow.engine.worker import _ShardWrites

    writes = _ShardWrites()
    release = concurrent.futures.Future()
    writes.start(2, lambda: {"shard": "stage-0"})
    writes.wait()
    assert writes.result(2, wait=False) == {"state": "written", "record": {"shard": "stage-0"}}
    assert writes.result(2, wait=False) == {"state": "written", "record": {"shard": "stage-0"}}
    assert writes.result(4, wait=False) == {"state": "none"}
    writes.start(4, release.result)
    assert writes.result(4, wait=False) == {"state": "writing"}
    assert writes.result(2, wait=False) == {"state": "none"}
    release.set_result({"shard": "stage-0 at 4"})
    assert writes.result(4, wait=True)["record"] == {"shard": "stage-0 at 4"}
    writes.close()
