"""``horovod`` for Horovod's own tests (tests/horovod_contract): its ``horovod.torch`` is
``ringflow.horovod``. Put this folder first on ``sys.path``; nothing else is provided."""
