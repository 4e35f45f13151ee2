"""This project's models. The package is named ``models``, as in most projects: ringflow's own
are installed as ``ringflow.models``, so neither shadows the other."""
