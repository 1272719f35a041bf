"""CheckpointStore against a real S3 endpoint (moto's standalone server): round trip, multipart, corruption,
crashes mid-commit, retention, an endpoint that goes down during an upload or a bucket that is missing (retried,
then StoreUnavailable with credentials masked), ownership claims, per-rank uploads and steps set aside."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
import time
from pathlib import Path

import boto3
import pytest

from sage_grpo.core.errors import StoreUnavailable
from sage_grpo.core.s3 import S3Config
from sage_grpo.core.storage import (
    MANIFEST_NAME,
    CheckpointConfig,
    CheckpointError,
    CheckpointStore,
    MiB,
    RootClaimedError,
)

pytestmark = pytest.mark.integration

PREFIX = "runs/test"
SMALL_FILES = {
    "engine/mp_rank_00_model_states.pt": 3000,
    "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt": 5000,
    "engine/zero_pp_rank_1_mp_rank_00_optim_states.pt": 5000,
    "pipeline_state.json": 100,
}
SHARD = "engine/zero_pp_rank_1_mp_rank_00_optim_states.pt"


def stage_checkpoint(directory: Path, seed: int, files: dict[str, int] = SMALL_FILES) -> Path:
    generator = random.Random(seed)
    for relpath, size in files.items():
        (directory / relpath).parent.mkdir(parents=True, exist_ok=True)
        (directory / relpath).write_bytes(generator.randbytes(size))
    return directory


def s3_store(endpoint_url: str, bucket: str, **settings) -> CheckpointStore:
    """A store at ``bucket``; ``settings``: keys of the ``checkpoint`` section or of the ``s3`` section."""
    s3 = {key: value for key, value in settings.items() if key in S3Config.model_fields}
    checkpoint = {key: value for key, value in settings.items() if key not in s3}
    config = CheckpointConfig(uri=f"s3://{bucket}/{PREFIX}", **checkpoint)
    return config.build(s3=S3Config(endpoint_url=endpoint_url, **s3))


def commit_step(store: CheckpointStore, tmp_path: Path, step: int, **extra) -> Path:
    staged = stage_checkpoint(tmp_path / f"staging-{step}", seed=step)
    store.commit(staged, step, world_size=2, config_hash="cfg-abc", extra=extra)
    return staged


def same_tree(left: Path, right: Path) -> bool:
    files = lambda base: {p.relative_to(base).as_posix(): p.read_bytes() for p in base.rglob("*") if p.is_file()}
    return files(left) == files(right)


@pytest.fixture
def s3(s3_server, aws_credentials):
    return boto3.client("s3", endpoint_url=s3_server)


@pytest.fixture
def store(s3_server, s3_bucket) -> CheckpointStore:
    return s3_store(s3_server, s3_bucket)


def test_round_trip_with_multipart_upload_and_ranged_download(tmp_path, s3_server, s3_bucket, s3, monkeypatch, caplog):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-that-must-never-be-logged")
    # s3transfer raises any part size below S3's 5 MiB minimum to 5 MiB, so 11 MiB is three parts.
    store = s3_store(s3_server, s3_bucket, multipart_threshold_bytes=1 * MiB, multipart_chunksize_bytes=5 * MiB)
    staged = stage_checkpoint(tmp_path / "staging", seed=1, files=SMALL_FILES | {"adapter/big.safetensors": 11 * MiB})

    with caplog.at_level(logging.DEBUG):
        store.commit(staged, 7, world_size=2, config_hash="cfg-abc")
        store.verify(7)
        store.download(7, tmp_path / "restored")

    assert "secret-that-must-never-be-logged" not in caplog.text
    big = s3.head_object(Bucket=s3_bucket, Key=f"{PREFIX}/step-7/adapter/big.safetensors")
    assert big["ETag"].strip('"').endswith("-3")  # a multipart ETag: md5-of-part-md5s, dash, part count
    assert same_tree(staged, tmp_path / "restored")
    manifest = json.loads(s3.get_object(Bucket=s3_bucket, Key=f"{PREFIX}/step-7/{MANIFEST_NAME}")["Body"].read())
    assert {entry["path"]: entry["sha256"] for entry in manifest["files"]} == {
        entry.relative_to(staged).as_posix(): hashlib.sha256(entry.read_bytes()).hexdigest()
        for entry in staged.rglob("*")
        if entry.is_file()
    }
    assert s3.get_object(Bucket=s3_bucket, Key=f"{PREFIX}/latest")["Body"].read() == b"7\n"
    assert store.list_steps() == [7] and store.resolve("auto") == 7


def put(s3, bucket: str, key: str, data: bytes) -> None:
    s3.put_object(Bucket=bucket, Key=f"{PREFIX}/{key}", Body=data)


def get(s3, bucket: str, key: str) -> bytes:
    return s3.get_object(Bucket=bucket, Key=f"{PREFIX}/{key}")["Body"].read()


def flip_middle_byte(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x01
    return bytes(flipped)


CORRUPTIONS = {
    "truncated_shard": lambda s3, bucket: put(s3, bucket, f"step-2/{SHARD}", get(s3, bucket, f"step-2/{SHARD}")[:100]),
    "flipped_byte": lambda s3, bucket: put(
        s3, bucket, f"step-2/{SHARD}", flip_middle_byte(get(s3, bucket, f"step-2/{SHARD}"))
    ),
    "zero_byte_file": lambda s3, bucket: put(s3, bucket, "step-2/pipeline_state.json", b""),
    "missing_manifest": lambda s3, bucket: s3.delete_object(Bucket=bucket, Key=f"{PREFIX}/step-2/{MANIFEST_NAME}"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_corruption_is_an_error_when_requested_and_skipped_by_auto(tmp_path, store, s3, s3_bucket, corruption):
    commit_step(store, tmp_path, 1)
    commit_step(store, tmp_path, 2)
    CORRUPTIONS[corruption](s3, s3_bucket)

    with pytest.raises(CheckpointError):
        store.resolve(2)
    with pytest.raises(CheckpointError):
        store.download(2, tmp_path / "restored")
    assert store.resolve("auto") == 1


def crash_after_first_upload(store: CheckpointStore, monkeypatch) -> None:
    upload_files = store.backend.upload_files

    def crashing_upload(files):
        upload_files(files[:1])
        raise RuntimeError("simulated crash mid-commit")

    monkeypatch.setattr(store.backend, "upload_files", crashing_upload)


def test_crash_mid_commit_leaves_latest_and_the_partial_step_alone(tmp_path, store, s3, s3_bucket, monkeypatch):
    for step in (1, 2, 3):
        commit_step(store, tmp_path, step)
    crash_after_first_upload(store, monkeypatch)
    with pytest.raises(RuntimeError, match="simulated crash"):
        commit_step(store, tmp_path, 4)

    assert store.latest_step() == 3 and store.list_steps() == [1, 2, 3]
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        store.resolve(4)
    assert store.prune(CheckpointConfig(keep_last=2)) == [1]
    partial = s3.list_objects_v2(Bucket=s3_bucket, Prefix=f"{PREFIX}/step-4/")["KeyCount"]
    assert partial == 1  # the in-flight step is not pruned
    assert store.resolve("auto") == 3


def test_failed_recommit_uncommits_the_step_instead_of_breaking_it(tmp_path, store, monkeypatch):
    commit_step(store, tmp_path, 1)
    commit_step(store, tmp_path, 2)
    crash_after_first_upload(store, monkeypatch)
    with pytest.raises(RuntimeError, match="simulated crash"):
        store.commit(stage_checkpoint(tmp_path / "other", seed=42), 2, world_size=2, config_hash="cfg-abc")

    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        store.resolve(2)
    assert store.resolve("auto") == 1


@pytest.mark.parametrize("bad_path", ["../../outside", "/outside", "engine/../../../outside"])
def test_manifest_keys_that_escape_the_prefix_are_rejected(tmp_path, store, s3, s3_bucket, bad_path):
    commit_step(store, tmp_path, 1)
    manifest = json.loads(get(s3, s3_bucket, f"step-1/{MANIFEST_NAME}"))
    manifest["files"][0]["path"] = bad_path
    put(s3, s3_bucket, f"step-1/{MANIFEST_NAME}", json.dumps(manifest).encode())

    with pytest.raises(CheckpointError, match="not a plain relative path"):
        store.verify(1)
    with pytest.raises(CheckpointError, match="not a plain relative path"):
        store.download(1, tmp_path / "restored" / "inner")
    assert not (tmp_path / "outside").exists() and not (tmp_path / "restored" / "outside").exists()
    with pytest.raises(CheckpointError):
        store.resolve(f"s3://{s3_bucket}/elsewhere/step-1")


def test_prune_deletes_whole_steps_and_keeps_best_and_latest(tmp_path, store, s3, s3_bucket):
    for step, reward in {1: 0.9, 2: 0.1, 3: 0.2, 4: 0.3, 5: 0.4}.items():
        commit_step(store, tmp_path, step, eval_reward=reward)
    store.backend.write_bytes("latest", b"3\n")

    assert store.prune(CheckpointConfig(keep_last=2, best_metric="eval_reward")) == [2]
    assert store.list_steps() == [1, 3, 4, 5]
    assert s3.list_objects_v2(Bucket=s3_bucket, Prefix=f"{PREFIX}/step-2/")["KeyCount"] == 0


def upload_first_file_then(store: CheckpointStore, monkeypatch, outage) -> None:
    """Make the next commit upload one file, run ``outage`` (the endpoint goes down), then upload the rest."""
    upload_files = store.backend.upload_files

    def upload_through_outage(files):
        upload_files(files[:1])
        outage()
        upload_files(files[1:])

    monkeypatch.setattr(store.backend, "upload_files", upload_through_outage)


def test_endpoint_down_during_upload_is_ridden_out_by_botocore_retries(
    tmp_path, restartable_s3_server, make_bucket, monkeypatch
):
    server = restartable_s3_server
    store = s3_store(
        server.endpoint_url,
        make_bucket(server.endpoint_url),
        max_attempts=8,
        connect_timeout_s=1.0,
        multipart_threshold_bytes=1 * MiB,
        multipart_chunksize_bytes=5 * MiB,
    )
    commit_step(store, tmp_path, 1)
    staged = stage_checkpoint(tmp_path / "staging-2", seed=2, files=SMALL_FILES | {"adapter/big.safetensors": 11 * MiB})
    restart = threading.Thread(target=lambda: (time.sleep(1.0), server.start()))

    def outage():
        server.stop()
        restart.start()

    upload_first_file_then(store, monkeypatch, outage)
    try:
        # Eight attempts with exponential backoff span far more than the one-second outage.
        store.commit(staged, 2, world_size=2, config_hash="cfg-abc")
    finally:
        restart.join()

    assert store.latest_step() == 2 and store.resolve("auto") == 2
    store.download(2, tmp_path / "restored")
    assert same_tree(staged, tmp_path / "restored")


def test_endpoint_down_longer_than_the_retries_leaves_the_step_uncommitted(
    tmp_path, restartable_s3_server, make_bucket, monkeypatch, caplog
):
    server = restartable_s3_server
    bucket = make_bucket(server.endpoint_url)
    # Credentials in the endpoint URL: botocore puts the URL in its connection errors.
    secret_endpoint = server.endpoint_url.replace("http://", "http://AKIAKEY:TOPSECRET@")
    store = s3_store(secret_endpoint, bucket, max_attempts=2, connect_timeout_s=1.0, outage_retry_s=2.0)
    commit_step(store, tmp_path, 1)
    upload_first_file_then(store, monkeypatch, server.stop)

    with caplog.at_level(logging.DEBUG, logger="sage_grpo.core"), pytest.raises(StoreUnavailable) as unavailable:
        commit_step(store, tmp_path, 2)
    server.start()

    # Bounded: after botocore's two attempts, our backoffs together stay within outage_retry_s.
    backoffs = [r.args[-1] for r in caplog.records if r.name.startswith("sage_grpo.core") and "retrying in" in r.msg]
    assert backoffs and sum(backoffs) <= 2.0
    message = str(unavailable.value)
    assert "\n" not in message and "TOPSECRET" not in message and "AKIAKEY" not in message
    assert "TOPSECRET" not in caplog.text and "retrying" in caplog.text
    assert (tmp_path / "staging-2" / SHARD).exists()  # the local staging is kept
    assert store.latest_step() == 1 and store.list_steps() == [1]
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        store.resolve(2)
    assert store.resolve("auto") == 1


def test_a_missing_bucket_is_retried_then_store_unavailable(tmp_path, s3_server, aws_credentials, caplog):
    store = s3_store(s3_server, "no-such-bucket-here", outage_retry_s=1.5)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(StoreUnavailable, match="NoSuchBucket"):
        commit_step(store, tmp_path, 1)
    # Retried (the loop stops once the next backoff would pass the deadline, so no lower bound on the time), not hung.
    assert "retrying in" in caplog.text and time.monotonic() - started < 30
    with pytest.raises(StoreUnavailable):  # reads too: an unreachable store is not a missing checkpoint
        store.resolve("auto")


def test_a_second_run_cannot_commit_to_a_claimed_root(tmp_path, s3_server, s3_bucket, s3):
    first, second = s3_store(s3_server, s3_bucket), s3_store(s3_server, s3_bucket)
    first.commit(stage_checkpoint(tmp_path / "a", seed=1), 1, world_size=2, config_hash="c", run_id="run-a")
    with pytest.raises(RootClaimedError, match="belongs to run run-a"):
        second.commit(stage_checkpoint(tmp_path / "b", seed=2), 1, world_size=2, config_hash="c", run_id="run-b")
    with pytest.raises(RootClaimedError):
        second.claim("run-b")  # the conditional put (If-None-Match: *) refuses to replace the owner file
    assert json.loads(get(s3, s3_bucket, "owner.json"))["run_id"] == "run-a"
    first.verify(1)


def test_ranks_upload_their_own_files_and_the_committer_writes_the_manifest(tmp_path, store):
    per_rank = {
        0: {"engine/zero_pp_rank_0_mp_rank_00_optim_states.pt": 4000, "pipeline_state_rank0.pt": 100},
        1: {"engine/zero_pp_rank_1_mp_rank_00_optim_states.pt": 4000, "pipeline_state_rank1.pt": 100},
    }
    staged = {
        rank: stage_checkpoint(tmp_path / f"node{rank}", seed=rank, files=files) for rank, files in per_rank.items()
    }
    store.begin_step(5, run_id="run-a")
    reported = {rank: store.upload_rank_files(5, rank, staged[rank]) for rank in staged}
    assert store.list_steps() == []
    with pytest.raises(CheckpointError, match="rank"):
        store.commit_manifest(5, {0: reported[0]}, world_size=2, config_hash="c", run_id="run-a")
    store.commit_manifest(5, reported, world_size=2, config_hash="c", run_id="run-a")

    assert store.resolve("auto") == 5
    store.download(5, tmp_path / "restored")
    for rank, files in per_rank.items():
        for relpath in files:
            assert (tmp_path / "restored" / relpath).read_bytes() == (staged[rank] / relpath).read_bytes()


def test_a_broken_step_is_moved_aside_not_overwritten(tmp_path, store, s3, s3_bucket):
    commit_step(store, tmp_path, 1)
    commit_step(store, tmp_path, 2)
    broken = flip_middle_byte(get(s3, s3_bucket, f"step-2/{SHARD}"))
    put(s3, s3_bucket, f"step-2/{SHARD}", broken)
    assert store.resolve("auto") == 1  # step 2 fails verification; the run goes on from step 1

    commit_step(store, tmp_path, 2)
    store.verify(2)
    aside = [
        item["Key"]
        for item in s3.list_objects_v2(Bucket=s3_bucket, Prefix=f"{PREFIX}/set-aside-step-2-").get("Contents", [])
    ]
    shard = [key for key in aside if key.endswith(SHARD)]
    assert len(shard) == 1 and s3.get_object(Bucket=s3_bucket, Key=shard[0])["Body"].read() == broken
    assert store.prune(CheckpointConfig(keep_last=2)) == []  # nothing set aside is ever a step to prune
