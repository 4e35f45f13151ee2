"""This project's Prefect tasks (``tasks``, beside ringflow's ``ringflow.tasks``)."""
