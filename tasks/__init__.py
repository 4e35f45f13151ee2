"""Prefect tasks: thin wrappers that call into ``engine`` and ``storage``."""

from tasks.preprocess import demo_data, preprocess
from tasks.registry import promote, register, warm_start_checkpoint
from tasks.resume import report_resume
from tasks.serve import serve, serve_production
from tasks.train import evaluate, train
from tasks.tune import tune

__all__ = [
    "demo_data",
    "evaluate",
    "preprocess",
    "promote",
    "register",
    "report_resume",
    "serve",
    "serve_production",
    "train",
    "tune",
    "warm_start_checkpoint",
]
