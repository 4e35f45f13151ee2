"""Your model, your data: models named by import path, the data deciding their width, one
``fit`` for both layouts, and bad input failing a run once, in one line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ringflow.engine import DataSpec, TrainConfig, fit
from ringflow.engine.errors import ModelError
from ringflow.engine.pipeline import PipelineConfig
from ringflow.engine.spec import ModelRef, build_module, import_model, model_hparams
from ringflow.models.tabular import TabularMLP
from ringflow.storage.dataset import infer_schema, preprocess
from tests.support.fitting import relative_difference

ROOT = Path(__file__).resolve().parents[1]


def write_table(path: Path, *, rows: int = 300, regression: bool, seed: int = 0) -> Path:
    """A CSV with named columns: three numbers and a colour, then the target."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (rows, 3))
    colours = rng.choice(["red", "green", "blue"], rows)
    score = 2 * x[:, 0] - x[:, 1] + 0.5 * x[:, 2] + (colours == "red")
    target = score if regression else np.digitize(score, [0.5, 1.2]).astype(int)
    lines = ["width,height,depth,colour,target"]
    lines += [
        f"{a:.4f},{b:.4f},{c:.4f},{colour},{t:.4f}" if regression else f"{a},{b},{c},{colour},{t}"
        for (a, b, c), colour, t in zip(x, colours, target, strict=True)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    root = tmp_path_factory.mktemp("tables")
    made = {}
    for kind in ("regression", "classification"):
        source = write_table(root / f"{kind}.csv", regression=kind == "regression")
        schema = infer_schema(str(source), label="target")
        made[kind] = DataSpec(dataset_url=preprocess(str(source), str(root), schema).dataset_url)
    return made


# ------------------------------------------------------------------------- the model by name


def test_a_model_is_imported_by_its_path():
    assert import_model("ringflow.models.tabular:TabularMLP") is TabularMLP
    ref = ModelRef(path="ringflow.models.tabular:TabularMLP", hparams={"hidden": 8})
    assert ref.name == "tabular_mlp"
    assert ModelRef(path="ringflow.models.digits:DigitsClassifier").name == "digits"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tabular.TabularMLP", "import path 'package.module:ClassName'"),
        ("nosuch.module:Model", "cannot import 'nosuch.module'"),
        ("ringflow.models.tabular:Nope", "has no 'Nope'"),
        ("ringflow.models.tabular:F", "is not a LightningModule class"),
        ("torch.nn:Linear", "must define training_step, validation_step, configure_optimizers"),
    ],
)
def test_a_bad_model_path_says_what_to_fix(path, message):
    with pytest.raises(ModelError, match=message):
        ModelRef(path=path).resolve()


def test_the_data_sets_the_width_and_the_classes(tables):
    regression, classification = tables["regression"], tables["classification"]
    assert model_hparams(TabularMLP, {"hidden": 8}, regression.schema) == {
        "hidden": 8,
        "input_dim": 4,
    }
    assert model_hparams(TabularMLP, {}, classification.schema) == {
        "input_dim": 4,
        "num_classes": 3,
    }
    with pytest.raises(ModelError, match="input_dim=7 does not match the data, which has 4"):
        model_hparams(TabularMLP, {"input_dim": 7}, regression.schema)


@pytest.mark.parametrize(
    ("hparams", "message"),
    [
        ({"input_dim": 3, "widht": 8}, "does not accept hparams .*it takes: input_dim"),
        ({"input_dim": 3, "depth": 0}, r"TabularMLP\(input_dim=3, depth=0\) refused its hparams"),
    ],
)
def test_a_constructor_that_refuses_its_hparams_is_named_in_one_line(hparams, message):
    with pytest.raises(ModelError, match=message) as refused:
        build_module(TabularMLP, hparams)
    assert "\n" not in str(refused.value)


def test_pipeline_code_imports_no_example_model():
    found = subprocess.run(
        ["grep", "-rnE", r"^\s*(from|import) (ringflow\.)?models\b", "flows", "tasks", "engine"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert found.returncode == 1, found.stdout


# ------------------------------------------------------------------------- one fit, two layouts


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"bucket_mb": 4.0}, "bucket_mb=4.0"),
        ({"timeline": True}, "timeline=True"),
        # On GPUs the replicas share one NCCL world: no elastic replicas there (on CPU they
        # are: tests/test_pipeline_ray.py).
        ({"gpus_per_worker": 1, "min_workers": 1}, "min_workers=1 .on GPUs"),
        ({"gpus_per_worker": 1, "commit_every": 5}, "commit_every=5 .on GPUs"),
    ],
)
def test_options_the_pipeline_cannot_honour_are_refused_before_anything_starts(
    options, named, tables, tmp_path
):
    init_from = options.pop("init_from", None)
    config = TrainConfig(workers=1, epochs=1, batch_size=32, **options)
    with pytest.raises(ValueError, match=f"with 2 pipeline stages .*{named}"):
        fit(
            TabularMLP,
            hparams={},
            data=tables["regression"],
            config=config,
            pipeline=PipelineConfig(stages=2),
            checkpoint_uri=str(tmp_path / "model"),
            init_from=init_from,
        )
    assert not any(tmp_path.iterdir()), "a refused run wrote something"


def test_a_pipeline_resumes_mid_epoch_bit_for_bit_through_the_shared_driver(tables, tmp_path):
    """Pipeline stages checkpoint every ``checkpoint_every`` steps, as data-parallel workers
    do; a run whose newest checkpoints were lost (a preemption between two of them) goes on
    from the mid-epoch one left and ends exactly where the uninterrupted run ends."""
    import shutil

    from ringflow.storage import CheckpointStore

    def run(store: str):
        return fit(
            TabularMLP,
            hparams={"hidden": 8, "depth": 3},
            data=tables["classification"],
            config=TrainConfig(workers=1, epochs=2, batch_size=32, seed=2, checkpoint_every=3),
            pipeline=PipelineConfig(stages=2, micro_batches=2),
            checkpoint_uri=str(tmp_path / "model"),
            in_process=True,
            store_url=store,
            run_key="cut",
        )

    whole = run(str(tmp_path / "store"))
    store = CheckpointStore(str(tmp_path / "store"))
    kept = [c.step for c in store.checkpoints("cut")]
    steps_per_epoch = kept[-1] // 2  # the last checkpoint ends the second epoch
    assert kept[0] > steps_per_epoch, kept
    assert kept[0] % steps_per_epoch, kept  # mid-epoch 2
    for newer in kept[1:]:  # keep the oldest: mid-epoch 2
        shutil.rmtree(tmp_path / "store" / "cut" / f"step-{newer:012d}")
    again = run(str(tmp_path / "store"))
    assert again.resumed_from == kept[0]
    assert [h.epoch for h in again.history] == [0, 1]
    for name, tensor in whole.state_dict.items():
        assert torch.equal(again.state_dict[name], tensor), name


@pytest.mark.ray
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_two_workers_end_with_the_weights_of_one_on_a_table_of_ones_own(
    kind, ray_session, tables, tmp_path
):
    states = {}
    for workers in (1, 2):
        result = fit(
            TabularMLP,
            hparams={"hidden": 16},
            data=tables[kind],
            config=TrainConfig(workers=workers, epochs=2, batch_size=32, seed=1),
            checkpoint_uri=str(tmp_path / f"w{workers}"),
        )
        states[workers] = result.state_dict
    assert relative_difference(states[2], states[1]) < 1e-5
    torch.manual_seed(1)  # the workers' initial weights, which training must have moved
    initial = TabularMLP(**model_hparams(TabularMLP, {"hidden": 16}, tables[kind].schema))
    assert relative_difference(states[1], initial.state_dict()) > 1e-2


@pytest.mark.ray
def test_the_sequence_model_on_two_replicas_of_two_stages_ends_with_one_workers_weights(
    ray_session, tmp_path
):
    from ringflow.models.charlm import CharLM, write_charlm_parquet

    hparams = {"context": 16, "width": 32, "depth": 2, "heads": 2}
    source = str(tmp_path / "text.parquet")
    write_charlm_parquet(source, context=16, max_chars=12_000)
    schema = infer_schema(source, label="label", classes=128)
    data = DataSpec(dataset_url=preprocess(source, str(tmp_path), schema).dataset_url)
    one = fit(
        CharLM,
        hparams=hparams,
        data=data,
        config=TrainConfig(workers=1, epochs=1, batch_size=64, seed=4),
        checkpoint_uri=str(tmp_path / "one"),
    )
    pipelined = fit(
        CharLM,
        hparams=hparams,
        data=data,
        config=TrainConfig(workers=2, epochs=1, batch_size=64, seed=4, cpus_per_worker=0.5),
        pipeline=PipelineConfig(stages=2, micro_batches=2),
        checkpoint_uri=str(tmp_path / "pipelined"),
    )
    assert relative_difference(pipelined.state_dict, one.state_dict) < 1e-5
    torch.manual_seed(4)
    assert relative_difference(one.state_dict, CharLM(**hparams).state_dict()) > 1e-3
