"""Hyperparameter search with Ray Tune; every trial trains through ``engine.fit``.

A search is identified by its run key. Under ``storage_url`` it keeps JSON records and
safetensors checkpoints only::

    {storage_url}/tune/{run_key}/trials/{trial}/starts/   one file per execution of the trial,
                                                          with its parameters and the step it
                                                          resumes from
    {storage_url}/tune/{run_key}/trials/{trial}/epochs/   the metrics of every epoch it trained
    {storage_url}/tune/{run_key}/trials/{trial}/rungs/    every decision the early-stopping
                                                          scheduler made on it, by epoch: the
                                                          metric and continue or stop
    {storage_url}/tune/{run_key}/trials/{trial}/stopped.json  the epoch the scheduler stopped it
    {storage_url}/tune/{run_key}/trials/{trial}/done.json  written once its training finished
    {storage_url}/checkpoints/{run_key}-trial-{trial}/    its training state (``CheckpointStore``)
    {storage_url}/runs/{run_key}/trials/{trial}/model     its trained model

Trials are numbered ``00000`` (the base configuration), ``00001``... Ray Tune runs them, and
keeps its own experiment state (pickles) in a scratch directory on the machine that drives
the search; it is never read back. Calling :func:`search` again with the same run key, on
this machine or another, rebuilds the search from the records: finished and stopped trials
are kept, unfinished ones resume from their newest checkpoint, the early-stopping scheduler
is given back every decision it made (and makes the ones the interruption cut off), the
searcher every result recorded, and trials never started are proposed again. Every storage
call is retried under ``SearchConfig.storage_retry``; a file under the search's directory
that is not one of these JSON records is reported and ignored.

Its rooms: :mod:`.space` (the space and the proposers that walk it), :mod:`.records` (what a
search keeps in storage and reads back), :mod:`.run` (the search on Ray Tune).
"""

from ringflow.tuning.run import SearchConfig, SearchResult, TrialSummary, search
from ringflow.tuning.space import SEARCH_ALGORITHMS, parse_space

__all__ = [
    "SEARCH_ALGORITHMS",
    "SearchConfig",
    "SearchResult",
    "TrialSummary",
    "parse_space",
    "search",
]
