"""``horovod`` for Horovod's own tests and examples (tests/horovod_contract,
tests/horovod_examples): its ``horovod.torch`` is ``ringflow.horovod`` and its
``horovod.ray`` is ``ringflow.horovod.ray``. Put this folder first on ``sys.path``; nothing
else is provided."""
