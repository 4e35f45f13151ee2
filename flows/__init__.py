"""Prefect flows. Each file holds one flow (``spec`` types their parameters, ``cli`` runs
them from a shell, ``preflight`` holds the checks the shell runs before heavy imports);
deployments live in ``deployments/``.

Nothing is imported here, so that ``python -m ringflow.flows.<name>`` can refuse a bad option
before Prefect, Ray or torch is loaded.
"""

__all__: list[str] = []
