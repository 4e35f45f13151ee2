"""Prefect flows. Each file holds one flow (``spec`` types their parameters, ``cli`` runs
them from a shell); deployments live in ``deployments/``.

Importing a flow imports its tasks, and with them Ray, which reads some settings only once, on
import: they are set here first, so a flow run from the command line keeps a local Ray quiet
and on loopback (``engine.cluster.QUIET_ENV``). Values already in the environment win.
"""

from ringflow.engine.cluster import quiet_environment

quiet_environment()

__all__: list[str] = []
