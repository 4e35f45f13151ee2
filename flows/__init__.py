"""Prefect flows. Each file holds one flow; deployments live in ``deployments/``."""

__all__: list[str] = []
