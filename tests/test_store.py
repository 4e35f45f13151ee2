"""CheckpointStore on file://, plain paths, memory:// and s3:// (moto behind a faulty proxy).

Every checkpoint test runs on each backend: commit-last, fallback past corrupt checkpoints,
retention, cleanup of interrupted writes, and never executing a planted pickle.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from ringflow.storage import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStorageError,
    CheckpointStore,
    RetentionPolicy,
    RetryPolicy,
)
from ringflow.storage.tensorfile import TensorFileError, decode, encode
from tests.moto_s3 import Faults, S3Endpoint, s3_endpoint

RUN = "run-1"
_FAST_RETRY = RetryPolicy(deadline_s=20.0, initial_backoff_s=0.05, max_backoff_s=0.5)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    with s3_endpoint(Faults(seed=7)) as endpoint:
        yield endpoint


@dataclass(frozen=True, kw_only=True)
class Backend:
    """A store URL, how to open it, and a fault-free way to tamper with its files."""

    name: str
    url: str
    options: dict[str, Any]
    direct_options: dict[str, Any]

    def store(self, **kwargs: Any) -> CheckpointStore:
        kwargs.setdefault("retry", _FAST_RETRY)
        return CheckpointStore(self.url, storage_options=self.options, **kwargs)

    def fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """The filesystem and root path, bypassing injected faults."""
        fs, root = fsspec.core.url_to_fs(self.url, **self.direct_options)
        fs.invalidate_cache()
        return fs, root.rstrip("/")


ALL = ["file", "plain", "memory", "s3", "s3-faults"]
"""Every backend; ``s3-faults`` answers 10% of requests with HTTP 500 and delays 10%."""
CORE = ["file", "memory", "s3"]
"""One of each kind, for the tests that would only repeat themselves on the others."""


@pytest.fixture(params=CORE)
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Backend]:
    name = request.param
    unique = uuid.uuid4().hex[:8]
    if name == "file":
        yield Backend(name=name, url=f"file://{tmp_path}/ckpt", options={}, direct_options={})
    elif name == "plain":
        yield Backend(name=name, url=str(tmp_path / "ckpt"), options={}, direct_options={})
    elif name == "memory":
        yield Backend(name=name, url=f"memory://ckpt-{unique}", options={}, direct_options={})
    else:
        s3: S3Endpoint = request.getfixturevalue("s3")
        faults = s3.proxy.faults
        if name == "s3-faults":
            faults.error_rate, faults.slow_rate, faults.slow_s = 0.1, 0.1, 0.1
        try:
            yield Backend(
                name=name,
                url=s3.url(f"ckpt-{unique}"),
                options=s3.storage_options(),
                direct_options=s3.storage_options(direct=True),
            )
        finally:
            faults.error_rate = faults.slow_rate = 0.0


def state(step: int) -> dict[str, dict[str, torch.Tensor]]:
    """Two shards with several dtypes, shapes including 0-d and empty, all derived from step."""
    generator = torch.Generator().manual_seed(step)
    return {
        "replicated": {
            "layer.weight": torch.randn(8, 5, generator=generator),
            "layer.bias": torch.randn(5, generator=generator).to(torch.bfloat16),
            "optim/layer.weight/step": torch.tensor(float(step)),
            "counts": torch.arange(step, step + 7, dtype=torch.int64),
            "mask": torch.tensor([True, False, step % 2 == 0]),
            "empty": torch.empty(0, 3),
        },
        "rank-00000": {"rng": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=generator)},
    }


def assert_same(actual: dict[str, dict[str, torch.Tensor]], step: int) -> None:
    expected = state(step)
    assert actual.keys() == expected.keys()
    for shard, tensors in expected.items():
        assert actual[shard].keys() == tensors.keys()
        for name, tensor in tensors.items():
            got = actual[shard][name]
            assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), name
            assert torch.equal(got, tensor), name


def save(store: CheckpointStore, step: int, **kwargs: Any) -> Any:
    return store.save(RUN, step=step, shards=state(step), metadata={"epoch": step // 2}, **kwargs)


# ---------------------------------------------------------------------------- basics


@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_save_then_load_is_bitwise_and_latest_is_idempotent(backend: Backend) -> None:
    store = backend.store()
    assert store.latest(RUN) is None
    assert store.load_latest(RUN) is None
    for step in (1, 2, 10):
        save(store, step, metrics={"loss": 1.0 / step})
    first, second = store.latest(RUN), store.latest(RUN)
    assert first == second
    assert first is not None
    assert first.step == 10
    assert first.metadata == {"epoch": 5}
    assert first.metrics == {"loss": 0.1}
    assert first.url == f"{store.url}/{RUN}/step-000000000010"
    loaded = store.load_latest(RUN)
    assert loaded is not None
    assert loaded.step == 10
    assert_same(loaded.shards, 10)
    loaded.shards["replicated"]["layer.weight"].add_(1)  # loaded tensors are writable
    assert [c.step for c in store.checkpoints(RUN)] == [1, 2, 10]
    partial = store.load(first, shards=["rank-00000"])
    assert list(partial.shards) == ["rank-00000"]


def test_a_store_opened_later_sees_the_same_latest(backend: Backend) -> None:
    save(backend.store(), 3)
    again = backend.store().load_latest(RUN)
    assert again is not None
    assert again.step == 3
    assert_same(again.shards, 3)


def test_written_shards_are_standard_safetensors(tmp_path: Any) -> None:
    store = CheckpointStore(str(tmp_path))
    checkpoint = save(store, 4)
    for name, record in checkpoint.shards.items():
        tensors = load_file(os.path.join(checkpoint.url, record.file))
        for key, tensor in state(4)[name].items():
            assert torch.equal(tensors[key], tensor)


@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_a_step_without_manifest_does_not_exist(backend: Backend) -> None:
    store = backend.store()
    save(store, 1)
    store.write_shard(RUN, step=2, name="replicated", tensors=state(2)["replicated"])
    assert store.latest(RUN).step == 1
    assert store.load_latest(RUN).step == 1


def test_two_phase_commit_from_records(backend: Backend) -> None:
    store = backend.store()
    records = [
        store.write_shard(RUN, step=5, name=name, tensors=tensors)
        for name, tensors in state(5).items()
    ]
    records = pickle.loads(pickle.dumps(records))  # they travel between processes
    assert store.latest(RUN) is None
    store.commit(RUN, step=5, shards=records, metadata={"world": {"ranks": 1}})
    loaded = store.load_latest(RUN)
    assert loaded.metadata == {"world": {"ranks": 1}}
    assert_same(loaded.shards, 5)


def test_saving_a_step_again_replaces_it_atomically(backend: Backend) -> None:
    store = backend.store()
    save(store, 1)
    first = save(store, 2)
    store.save(RUN, step=2, shards=state(7), metadata={"again": True})
    loaded = store.load_latest(RUN)
    assert loaded.step == 2
    assert loaded.metadata == {"again": True}
    assert_same(loaded.shards, 7)
    fs, root = backend.fs()
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/{RUN}/step-000000000002", detail=False)}
    assert not names & {r.file for r in first.shards.values()}  # the old files are gone


# ---------------------------------------------------------------------------- corruption


def _flip_byte(fs: Any, path: str) -> None:
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(path, bytes(data))


def _truncate(fs: Any, path: str) -> None:
    fs.pipe_file(path, fs.cat_file(path)[:-5])


class _Payload:
    """Unpickling this creates a marker file: proof that a pickle was executed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


@pytest.mark.parametrize(
    "damage", ["flip_byte", "truncate", "delete_manifest", "delete_shard", "edit_manifest"]
)
def test_a_damaged_checkpoint_is_skipped_with_a_warning(
    backend: Backend, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = backend.store()
    save(store, 1)
    checkpoint = save(store, 2)
    fs, root = backend.fs()
    step_dir = f"{root}/{RUN}/step-000000000002"
    shard = f"{step_dir}/{checkpoint.shards['replicated'].file}"
    manifest = f"{step_dir}/manifest.json"
    if damage == "flip_byte":
        _flip_byte(fs, shard)
    elif damage == "truncate":
        _truncate(fs, shard)
    elif damage == "delete_manifest":
        fs.rm_file(manifest)
    elif damage == "delete_shard":
        fs.rm_file(shard)
    else:
        body = json.loads(fs.cat_file(manifest))
        body["metadata"]["epoch"] = 99  # still valid JSON, so only the checksum can tell
        fs.pipe_file(manifest, json.dumps(body).encode())
    bad = manifest if damage in ("delete_manifest", "edit_manifest") else shard
    bad_name = bad.rsplit("/", 1)[-1]

    with caplog.at_level(logging.WARNING, logger="ringflow.storage.store"):
        loaded = store.load_latest(RUN)
    assert loaded is not None
    assert loaded.step == 1
    assert_same(loaded.shards, 1)
    assert any(bad_name in r.getMessage() for r in caplog.records), caplog.text
    assert store.latest(RUN).step == 1
    if damage in ("flip_byte", "truncate", "delete_shard"):
        with pytest.raises(CheckpointCorruptError, match=bad_name):
            store.load(checkpoint)
        assert store.latest(RUN, verify="size" if damage != "flip_byte" else "checksum").step == 1


@pytest.mark.parametrize("forge_manifest", [False, True])
def test_a_planted_pickle_is_never_executed(
    backend: Backend, tmp_path: Any, forge_manifest: bool
) -> None:
    store = backend.store()
    save(store, 1)
    checkpoint = save(store, 2)
    marker = str(tmp_path / "pickle-ran")
    payload = pickle.dumps(_Payload(marker))
    fs, root = backend.fs()
    step_dir = f"{root}/{RUN}/step-000000000002"
    record = checkpoint.shards["replicated"]
    fs.pipe_file(f"{step_dir}/{record.file}", payload)
    fs.pipe_file(f"{step_dir}/model.pt", payload)  # a stray file is never read either
    if forge_manifest:
        # A manifest rewritten to match the pickle: size and checksum pass, the format cannot.
        manifest = _forge(fs.cat_file(f"{step_dir}/manifest.json"), record.file, payload)
        fs.pipe_file(f"{step_dir}/manifest.json", manifest)

    loaded = store.load_latest(RUN)
    with pytest.raises(CheckpointCorruptError, match=record.file):
        store.load(store.checkpoints(RUN)[-1] if forge_manifest else checkpoint)
    assert loaded is not None
    assert loaded.step == 1
    assert not os.path.exists(marker)


def _forge(manifest: bytes, file: str, payload: bytes) -> bytes:
    """Rewrite a manifest so that ``file`` matches ``payload``, with a valid checksum."""
    body = json.loads(manifest)
    for entry in body["shards"].values():
        if entry["file"] == file:
            entry.update(size=len(payload), checksum=f"crc32:{zlib.crc32(payload):08x}")
    return _with_checksum(body)


def _with_checksum(body: dict[str, Any]) -> bytes:
    """The manifest checksum: SHA-256 of the canonical JSON of everything else."""
    body.pop("checksum", None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(canonical).hexdigest()
    return json.dumps({**body, "checksum": f"sha256:{digest}"}).encode()


def test_a_manifest_pointing_outside_its_step_is_refused(backend: Backend) -> None:
    store = backend.store()
    save(store, 1)
    save(store, 2)
    fs, root = backend.fs()
    path = f"{root}/{RUN}/step-000000000002/manifest.json"
    body = json.loads(fs.cat_file(path))
    body["shards"]["replicated"]["file"] = "../step-000000000001/x.safetensors"
    fs.pipe_file(path, _with_checksum(body))
    assert store.load_latest(RUN).step == 1


# ---------------------------------------------------------------------------- retention


def test_retention_keeps_the_last_and_the_best(backend: Backend) -> None:
    policy = RetentionPolicy(keep_last=2, keep_best=1, metric="val_loss", mode="min")
    store = backend.store(retention=policy)
    for step, loss in zip(range(1, 7), [5.0, 1.0, 4.0, 3.0, 2.0, 6.0], strict=True):
        save(store, step, metrics={"val_loss": loss})
    assert [c.step for c in store.checkpoints(RUN)] == [2, 5, 6]
    fs, root = backend.fs()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/{RUN}", detail=False)) == [
        "step-000000000002",
        "step-000000000005",
        "step-000000000006",
    ]


def test_retention_policy_decides_without_storage() -> None:
    from ringflow.storage import CommittedCheckpoint

    def checkpoint(step: int, accuracy: float | None) -> CommittedCheckpoint:
        metrics = {} if accuracy is None else {"acc": accuracy}
        return CommittedCheckpoint(
            url="", run_key=RUN, step=step, shards={}, metadata={}, metrics=metrics, created=""
        )

    checkpoints = [
        checkpoint(1, 0.9),
        checkpoint(2, None),
        checkpoint(3, float("nan")),
        checkpoint(4, 0.9),
        checkpoint(5, 0.1),
    ]
    policy = RetentionPolicy(keep_last=1, keep_best=1, metric="acc", mode="max")
    assert policy.steps_to_keep(checkpoints) == {5, 4}  # ties go to the newer
    assert RetentionPolicy(keep_last=None).steps_to_keep(checkpoints) == {1, 2, 3, 4, 5}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"keep_last": 0}, "keep_last"),
        ({"keep_best": -1}, "keep_best"),
        ({"keep_best": 2}, "metric"),
        ({"mode": "up"}, "mode"),
    ],
)
def test_retention_policy_rejects_bad_values(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RetentionPolicy(**kwargs)


# ---------------------------------------------------------------------------- leftovers


@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_leftovers_of_interrupted_writes_are_removed_after_the_next_commit(
    backend: Backend,
) -> None:
    store = backend.store()
    save(store, 1)
    store.write_shard(RUN, step=2, name="replicated", tensors=state(2)["replicated"])  # killed
    orphan = store.write_shard(RUN, step=3, name="replicated", tensors=state(3)["replicated"])
    fs, root = backend.fs()
    fs.pipe_file(f"{root}/{RUN}/step-000000000003/manifest.json.tmp-dead", b"{")
    assert store.load_latest(RUN).step == 1
    committed = save(store, 3)  # resumed from 1, reached step 3 again
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/{RUN}", detail=False))
    assert names == ["step-000000000001", "step-000000000003"]
    files = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/{RUN}/step-000000000003", detail=False)}
    assert files == {"manifest.json", *(r.file for r in committed.shards.values())}
    assert orphan.file not in files
    assert_same(store.load_latest(RUN).shards, 3)


def test_cleanup_leaves_writes_above_the_newest_commit(backend: Backend) -> None:
    store = backend.store()
    save(store, 1)
    save(store, 3)
    store.write_shard(RUN, step=2, name="replicated", tensors=state(2)["replicated"])
    store.write_shard(RUN, step=4, name="replicated", tensors=state(4)["replicated"])
    removed = store.cleanup(RUN)
    assert [u.rsplit("/", 1)[-1] for u in removed] == ["step-000000000002"]
    fs, root = backend.fs()
    assert fs.exists(f"{root}/{RUN}/step-000000000004")


# ---------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"run_key": "a/b"}, "run_key"),
        ({"run_key": ""}, "run_key"),
        ({"step": -1}, "step"),
        ({"step": True}, "step"),
        ({"shards": {"../x": {"t": torch.zeros(1)}}}, "shard name"),
        ({"shards": {}}, "shards"),
        ({"metadata": {"when": object()}}, "metadata"),
        ({"metrics": {"loss": "low"}}, "metrics"),
        ({"shards": {"s": {"t": torch.zeros(1, dtype=torch.complex64)}}}, "dtype"),
    ],
)
def test_bad_arguments_are_refused_with_the_field_named(
    tmp_path: Any, kwargs: dict[str, Any], message: str
) -> None:
    store = CheckpointStore(str(tmp_path))
    arguments = {"run_key": RUN, "step": 1, "shards": {"s": {"t": torch.zeros(1)}}, **kwargs}
    run_key = arguments.pop("run_key")
    with pytest.raises(ValueError, match=message):
        store.save(run_key, **arguments)
    assert store.latest(RUN) is None


def test_an_unknown_protocol_names_the_package_to_install() -> None:
    with pytest.raises(ValueError, match="fsspec package"):
        CheckpointStore("nosuchproto://bucket/x")


# ---------------------------------------------------------------------------- s3 faults


def test_s3_faults_are_retried_and_nothing_is_lost(s3: S3Endpoint) -> None:
    faults = s3.proxy.faults
    before = dict(faults.counts)
    faults.error_rate, faults.slow_rate, faults.slow_s = 0.2, 0.1, 0.2
    try:
        store = CheckpointStore(
            s3.url(f"faults-{uuid.uuid4().hex[:8]}"),
            storage_options=s3.storage_options(),
            retry=_FAST_RETRY,
            retention=RetentionPolicy(keep_last=2),
        )
        for step in range(4):
            save(store, step)
            loaded = store.load_latest(RUN)
            assert loaded.step == step
            assert_same(loaded.shards, step)
    finally:
        faults.error_rate = faults.slow_rate = 0.0
    assert faults.counts["500"] - before["500"] >= 3  # the retries had something to do
    assert [c.step for c in store.checkpoints(RUN)] == [2, 3]


def test_s3_outage_raises_instead_of_falling_back(s3: S3Endpoint) -> None:
    url = s3.url(f"outage-{uuid.uuid4().hex[:8]}")
    store = CheckpointStore(
        url,
        storage_options=s3.storage_options(),
        retry=RetryPolicy(deadline_s=1.0, initial_backoff_s=0.05, max_backoff_s=0.2),
    )
    save(store, 1)
    save(store, 2)
    s3.proxy.faults.error_rate = 1.0
    s3.proxy.faults.methods = frozenset({"GET"})
    try:
        with pytest.raises(CheckpointStorageError, match="deadline_s"):
            store.load_latest(RUN)
    finally:
        s3.proxy.faults.error_rate = 0.0
        s3.proxy.faults.methods = Faults().methods
    assert store.load_latest(RUN).step == 2


def test_a_missing_bucket_fails_fast_with_a_hint(s3: S3Endpoint) -> None:
    store = CheckpointStore("s3://no-such-bucket/x", storage_options=s3.storage_options())
    with pytest.raises(CheckpointStorageError, match="storage_options"):
        store.check_writable()


# ---------------------------------------------------------------------------- safetensors


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(position=st.integers(min_value=0, max_value=10_000), value=st.integers(0, 255))
def test_decoding_damaged_bytes_raises_only_tensor_file_error(position: int, value: int) -> None:
    encoded = encode(
        {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int16)}
    )
    data = bytearray(b"".join(encoded.chunks))
    data[position % len(data)] = value
    try:
        tensors, index = decode(_uint8(data))
    except TensorFileError:
        return
    # A flip in the data or in the header's padding still decodes, and consistently.
    assert all(list(tensors[name].shape) == shape for name, (_, shape) in index.items())


def test_decode_refuses_a_pickle() -> None:
    with pytest.raises(TensorFileError):
        decode(_uint8(pickle.dumps({"a": torch.zeros(2)})))


def test_errors_pickle_so_they_can_cross_a_ray_actor() -> None:
    error = pickle.loads(pickle.dumps(CheckpointCorruptError("s3://b/x.safetensors", "is bad")))
    assert isinstance(error, CheckpointError)
    assert (error.url, str(error)) == ("s3://b/x.safetensors", "s3://b/x.safetensors is bad")


def test_sha256_checksums_are_written_and_verified(tmp_path: Any) -> None:
    store = CheckpointStore(str(tmp_path), checksum="sha256")
    checkpoint = save(store, 1)
    assert all(r.checksum.startswith("sha256:") for r in checkpoint.shards.values())
    assert_same(CheckpointStore(str(tmp_path)).load_latest(RUN).shards, 1)  # crc32 store reads it
    path = os.path.join(checkpoint.url, checkpoint.shards["replicated"].file)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(CheckpointCorruptError, match="fails its sha256 checksum"):
        store.load(checkpoint)


def _uint8(data: bytes | bytearray) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
