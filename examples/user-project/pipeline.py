"""This project's own flow: its tasks first, then ringflow's, in the order it chooses.

python pipeline.py                     # one local run, no server needed
prefect deploy --all                   # or deploy it (prefect.yaml) and run it on a worker
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run
from ringflow.engine import TrainConfig
from ringflow.engine.spec import ModelRef
from ringflow.tasks import evaluate, preprocess, promote, register, serve_production, train

from tasks.features import add_ratios, prepare_wine

MODEL = "models.wine:WineClassifier"
NAME = "wine"


@flow(name="wine-pipeline")
def wine_pipeline(
    storage_url: str = ".ringflow/storage",
    workers: int = 2,
    epochs: int = 40,
    hidden: int = 32,
    lr: float = 0.02,
    serve_port: int = 8000,
) -> dict:
    """Export the wine table, add ratio features, then validate, train, gate and serve."""
    run_key = str(flow_run.get_id() or "local")
    table = add_ratios(prepare_wine(storage_url), storage_url)
    dataset = preprocess(table, storage_url, label="cultivar", seed=0)
    model = ModelRef(path=MODEL, hparams={"hidden": hidden, "lr": lr})
    trained = train(
        model,
        dataset["dataset_url"],
        storage_url,
        run_key=run_key,
        config=TrainConfig(workers=workers, epochs=epochs, batch_size=32, seed=0),
    )
    metrics = evaluate(trained["checkpoint"], dataset["dataset_url"], model=MODEL)
    version = register(
        trained["checkpoint"],
        storage_url,
        metrics=metrics,
        dataset_url=dataset["dataset_url"],
        run_key=run_key,
        model=NAME,
    )
    gate = promote(version["version"], storage_url, model=NAME, allowed=[MODEL])
    served = serve_production(
        storage_url, dataset["dataset_url"], port=serve_port, model=NAME, model_path=MODEL
    )
    return {
        **metrics,
        "model_version": version["version"],
        "promoted": gate["promoted"],
        "rejected_rows": dataset["rejected_rows"],
        **served,
    }


if __name__ == "__main__":
    print(wine_pipeline())
