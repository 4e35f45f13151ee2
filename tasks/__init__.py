"""Prefect tasks: thin wrappers that call into ``engine`` and ``storage``."""

from tasks.preprocess import demo_data, preprocess
from tasks.serve import serve
from tasks.train import evaluate, publish, train
from tasks.tune import tune

__all__ = ["demo_data", "evaluate", "preprocess", "publish", "serve", "train", "tune"]
