"""CheckpointStore on a local directory (file:// root): commit protocol, verification, resume choice, retention."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path

import pytest
import torch
from botocore.exceptions import ClientError, EndpointConnectionError
from pydantic import ValidationError
from safetensors.torch import save_file

from sage_grpo.core.errors import StoreUnavailable, UserError
from sage_grpo.core.s3 import S3Config
from sage_grpo.core.storage import (
    MANIFEST_NAME,
    CheckpointConfig,
    CheckpointError,
    CheckpointStore,
    RootClaimedError,
    StorageError,
    load_tensors,
    load_torch,
)
from sage_grpo.core.storage import store as store_module
from sage_grpo.core.storage.manifest import file_entry

pytestmark = pytest.mark.unit

# What a DeepSpeed ZeRO checkpoint of two ranks plus the pipeline's own files look like in a staging directory.
STAGED_FILES = {
    "engine/mp_rank_00_model_states.pt": 3000,
    "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt": 5000,
    "engine/zero_pp_rank_1_mp_rank_00_optim_states.pt": 5000,
    "adapter/adapter_model.safetensors": 2000,
    "pipeline_state.json": 100,
}
SHARD = "engine/zero_pp_rank_1_mp_rank_00_optim_states.pt"


def stage_checkpoint(directory: Path, seed: int) -> Path:
    generator = random.Random(seed)
    for relpath, size in STAGED_FILES.items():
        (directory / relpath).parent.mkdir(parents=True, exist_ok=True)
        (directory / relpath).write_bytes(generator.randbytes(size))
    return directory


def commit_step(store: CheckpointStore, tmp_path: Path, step: int, **extra) -> Path:
    staged = stage_checkpoint(tmp_path / f"staging-{step}", seed=step)
    store.commit(staged, step, world_size=2, config_hash="cfg-abc", extra=extra)
    return staged


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "check points"  # a space, so that file:// URIs carry percent-escapes


@pytest.fixture
def store(root) -> CheckpointStore:
    return CheckpointConfig(uri=root.as_uri()).build()


def same_tree(left: Path, right: Path) -> bool:
    files = lambda base: {p.relative_to(base).as_posix(): p.read_bytes() for p in base.rglob("*") if p.is_file()}
    return files(left) == files(right)


@pytest.mark.parametrize("root_form", ["file_uri", "plain_path"])
def test_commit_then_download_round_trip(tmp_path, root, root_form):
    store = CheckpointConfig(uri=root.as_uri() if root_form == "file_uri" else str(root)).build()
    staged = commit_step(store, tmp_path, 5, eval_reward=0.25)

    manifest = json.loads((root / "step-5" / MANIFEST_NAME).read_text())
    assert (manifest["step"], manifest["world_size"], manifest["config_hash"]) == (5, 2, "cfg-abc")
    assert manifest["extra"] == {"eval_reward": 0.25} and manifest["created"]
    assert {entry["path"]: (entry["size"], entry["sha256"]) for entry in manifest["files"]} == {
        relpath: ((staged / relpath).stat().st_size, hashlib.sha256((staged / relpath).read_bytes()).hexdigest())
        for relpath in STAGED_FILES
    }
    assert (root / "latest").read_text() == "5\n"
    assert store.list_steps() == [5] and store.latest_step() == 5
    store.verify(5)
    store.download(5, tmp_path / "restored")
    assert same_tree(staged, tmp_path / "restored")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def empty(path: Path) -> None:
    path.write_bytes(b"")


CORRUPTIONS = {
    "truncated_shard": (SHARD, truncate),
    "flipped_byte": (SHARD, flip_byte),
    "zero_byte_file": ("adapter/adapter_model.safetensors", empty),
    "missing_manifest": (MANIFEST_NAME, Path.unlink),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_corruption_is_an_error_when_requested_and_skipped_by_auto(tmp_path, root, store, corruption, caplog):
    commit_step(store, tmp_path, 1)
    commit_step(store, tmp_path, 2)
    relpath, corrupt = CORRUPTIONS[corruption]
    corrupt(root / "step-2" / relpath)

    with pytest.raises(CheckpointError):
        store.resolve(2)
    with pytest.raises(CheckpointError):
        store.download(2, tmp_path / "restored")
    with caplog.at_level(logging.INFO, logger="sage_grpo.core.storage"):
        assert store.resolve("auto") == 1
    assert "step-1" in caplog.text


def test_auto_is_none_without_a_checkpoint(store):
    assert store.resolve("auto") is None


def test_auto_ignores_steps_after_the_latest_pointer(tmp_path, store):
    commit_step(store, tmp_path, 1)
    commit_step(store, tmp_path, 2)
    store.backend.write_bytes("latest", b"1\n")  # step 2: abandoned branch, or its pointer write was lost
    assert store.resolve("auto") == 1
    assert store.resolve(2) == 2  # still there for whoever asks for it by name


def upload_first_file_then_crash(store, monkeypatch):
    upload_files = store.backend.upload_files

    def crashing_upload(files):
        upload_files(files[:1])
        raise RuntimeError("simulated crash mid-commit")

    monkeypatch.setattr(store.backend, "upload_files", crashing_upload)


def crash_writing_manifest(store, monkeypatch):
    write_bytes = store.backend.write_bytes

    def crashing_write(key, data):
        if key.endswith(MANIFEST_NAME):
            raise RuntimeError("simulated crash before the manifest")
        write_bytes(key, data)

    monkeypatch.setattr(store.backend, "write_bytes", crashing_write)


@pytest.mark.parametrize("crash", [upload_first_file_then_crash, crash_writing_manifest])
def test_crash_mid_commit_leaves_latest_and_commits_nothing(tmp_path, root, store, monkeypatch, crash):
    commit_step(store, tmp_path, 1)
    crash(store, monkeypatch)
    with pytest.raises(RuntimeError, match="simulated crash"):
        commit_step(store, tmp_path, 2)

    assert store.latest_step() == 1 and store.list_steps() == [1]
    assert sorted(path.name for path in root.iterdir()) == ["latest", "step-1"]  # staging cleaned up
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        store.resolve(2)
    assert store.resolve("auto") == 1


def test_recommit_replaces_a_step_whole(tmp_path, root, store):
    commit_step(store, tmp_path, 3)
    second = stage_checkpoint(tmp_path / "second", seed=99)
    (second / "only-in-second.txt").write_text("new")
    store.commit(second, 3, world_size=2, config_hash="cfg-abc")

    store.download(3, tmp_path / "restored")
    assert same_tree(second, tmp_path / "restored")
    assert sorted(path.name for path in root.iterdir()) == ["latest", "step-3"]


@pytest.mark.parametrize(
    "bad_path", ["../outside.bin", "/tmp/outside.bin", "engine/../../outside.bin", "a//b", "./x", "a\\..\\b"]
)
def test_manifest_paths_that_escape_the_checkpoint_are_rejected(tmp_path, root, store, bad_path):
    commit_step(store, tmp_path, 1)
    manifest_path = root / "step-1" / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][0]["path"] = bad_path
    manifest_path.write_text(json.dumps(manifest))

    for action in (lambda: store.verify(1), lambda: store.download(1, tmp_path / "restored" / "inner")):
        with pytest.raises(CheckpointError, match="invalid manifest"):
            action()
    assert not (tmp_path / "restored" / "outside.bin").exists() and not (tmp_path / "outside.bin").exists()


def test_resolve_accepts_step_number_name_and_uri_under_the_root(tmp_path, root, store):
    commit_step(store, tmp_path, 3)
    for resume in (3, "3", "step-3", f"{root.as_uri()}/step-3", f"{root}/step-3/"):
        assert store.resolve(resume) == 3
    for resume in (f"{tmp_path / 'elsewhere'}/step-3", "s3://bucket/step-3", "latest", "step-03"):
        with pytest.raises(CheckpointError, match="is not 'auto'"):
            store.resolve(resume)


def test_prune_keeps_last_k_best_latest_and_uncommitted(tmp_path, root, store):
    rewards = {1: 0.1, 2: 0.9, 3: 0.2, 4: 0.3, 5: 0.4, 6: 0.5}
    for step, reward in rewards.items():
        commit_step(store, tmp_path, step, eval_reward=reward)
    store.backend.write_bytes("latest", b"3\n")  # e.g. a run restarted from step 3
    in_flight = stage_checkpoint(root / "step-7", seed=7)  # files, no manifest yet

    assert store.prune(CheckpointConfig(keep_last=2, best_metric="eval_reward")) == [1, 4]
    assert store.list_steps() == [2, 3, 5, 6]
    assert same_tree(in_flight, root / "step-7")


def test_prune_best_can_be_the_lowest(tmp_path, store):
    for step, loss in {1: 0.1, 2: 0.5, 3: 0.7, 4: 0.9}.items():
        commit_step(store, tmp_path, step, eval_loss=loss)
    assert store.prune(CheckpointConfig(keep_last=2, best_metric="eval_loss", higher_is_better=False)) == [2]


def test_prune_logs_a_failed_deletion_and_carries_on(tmp_path, store, monkeypatch, caplog):
    for step in range(1, 5):
        commit_step(store, tmp_path, step)
    delete_tree = store.backend.delete_tree

    def failing_delete_tree(prefix):
        if prefix == "step-1":
            raise PermissionError("read-only")
        delete_tree(prefix)

    monkeypatch.setattr(store.backend, "delete_tree", failing_delete_tree)
    with caplog.at_level(logging.WARNING, logger="sage_grpo.core.storage"):
        assert store.prune(CheckpointConfig(keep_last=2)) == [2]
    assert "could not delete" in caplog.text and "read-only" in caplog.text
    assert store.list_steps() == [3, 4]  # step 1 lost its manifest first: leftover files, never a broken checkpoint


def test_retention_refuses_to_keep_a_single_checkpoint():
    # The one check of the rule: prune takes its retention from a CheckpointConfig, which cannot hold fewer than two.
    with pytest.raises(ValidationError, match="keep_last"):
        CheckpointConfig(keep_last=1)


def test_commit_refuses_empty_or_reserved_staging(tmp_path, store):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no files"):
        store.commit(tmp_path / "empty", 1, world_size=1, config_hash="x")
    (tmp_path / "reserved" / MANIFEST_NAME).parent.mkdir()
    (tmp_path / "reserved" / MANIFEST_NAME).write_text("{}")
    with pytest.raises(ValueError, match="reserved"):
        store.commit(tmp_path / "reserved", 1, world_size=1, config_hash="x")


def test_config_checks_its_values_and_defaults_to_the_output_dir(tmp_path):
    for bad in (
        {"uri": "gs://bucket/run"},
        {"uri": "s3:///run"},
        {"endpoint_url": "http://minio:9000"},  # the s3 section's now
        {"keep_last": 1},
        {"unknown_key": 1},
    ):
        with pytest.raises(ValidationError):
            CheckpointConfig(**bad)
    assert CheckpointConfig().build(output_dir=tmp_path).uri == str(tmp_path / "checkpoints")
    with pytest.raises(UserError, match="checkpoint.uri"):
        CheckpointConfig().build()


def test_load_tensors_reads_safetensors(tmp_path):
    tensors = {"lora_A.weight": torch.randn(4, 2), "lora_B.weight": torch.zeros(2, 4)}
    save_file(tensors, tmp_path / "adapter.safetensors")
    loaded = load_tensors(tmp_path / "adapter.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)


class Payload:
    """Stands in for an object an attacker pickled into a checkpoint."""


def test_load_torch_reads_tensors_but_never_arbitrary_objects(tmp_path):
    torch.save({"step": 3, "weight": torch.ones(2)}, tmp_path / "state.pt")
    assert torch.equal(load_torch(tmp_path / "state.pt")["weight"], torch.ones(2))
    torch.save({"payload": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="Payload, which is not on the allow-list") as refused:
        load_torch(tmp_path / "evil.pt")
    assert "\n" not in str(refused.value) and "weights_only=False" not in str(refused.value)


# --- Storage URIs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "uri",
    [
        "s3://ckpt/../evil/run2",
        "s3://ckpt/a/./b//c",
        "s3://ckpt//run",
        "s3://ckpt/a/..",
        "file:///data/../etc/run",
        "file:///data/./run",
        "s3://KEY:SECRET@ckpt/run",
    ],
)
def test_uris_with_dot_dotdot_or_empty_segments_are_refused_at_config_time(uri):
    with pytest.raises(ValidationError) as refused:
        CheckpointConfig(uri=uri)
    assert "SECRET" not in refused.value.errors()[0]["msg"]  # what the CLI prints (core.config_loading.one_line)


@pytest.mark.parametrize("uri", ["s3://ckpt/runs/a/", "s3://ckpt", "s3://ckpt.example-1/a.b/c..d/.hidden"])
def test_ordinary_s3_uris_are_accepted(uri):
    assert CheckpointConfig(uri=uri).uri == uri


def test_an_endpoint_url_is_an_http_url_and_refusals_mask_its_credentials():
    with pytest.raises(ValidationError) as refused:
        S3Config(endpoint_url="ftp://KEY:SECRET@minio:9000")
    assert "SECRET" not in str(refused.value.errors()[0]["msg"])
    assert S3Config(endpoint_url="http://minio:9000").endpoint_url == "http://minio:9000"


# --- Outages -----------------------------------------------------------------------------------------------------


def unreachable_endpoint(store, monkeypatch) -> list[int]:
    """Every upload fails the way botocore reports a dead endpoint (after its own retries): with the URL."""
    calls = []

    def failing_upload(files):
        calls.append(len(files))
        raise EndpointConnectionError(endpoint_url="http://AKIAKEY:TOPSECRET@minio.internal:9000/ckpt/step-2/x")

    monkeypatch.setattr(store.backend, "upload_files", failing_upload)
    clock = [1000.0]  # a fake clock that only sleeping advances
    monkeypatch.setattr(store_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(store_module.time, "sleep", lambda seconds: clock.__setitem__(0, clock[0] + seconds))
    return calls


def test_an_outage_is_retried_within_a_bound_then_store_unavailable_with_credentials_masked(
    tmp_path, root, monkeypatch, caplog
):
    store = CheckpointConfig(uri=str(root), outage_retry_s=10).build()
    commit_step(store, tmp_path, 1)
    calls = unreachable_endpoint(store, monkeypatch)
    staged = stage_checkpoint(tmp_path / "staging-2", seed=2)

    with caplog.at_level(logging.DEBUG), pytest.raises(StoreUnavailable) as unavailable:
        store.commit(staged, 2, world_size=2, config_hash="cfg-abc")

    assert len(calls) == 4  # tried, then retried after 1, 2 and 4 s; the next wait (8 s) would pass the 10 s bound
    message = str(unavailable.value)
    assert "\n" not in message and "TOPSECRET" not in message and "***@minio.internal" in message
    assert "TOPSECRET" not in caplog.text and "retrying" in caplog.text
    assert unavailable.value.exit_code == 75 and not isinstance(unavailable.value, UserError)
    assert same_tree(staged, stage_checkpoint(tmp_path / "again", seed=2))  # the staging is kept as it was
    assert store.latest_step() == 1 and store.list_steps() == [1]


def test_a_refusal_is_not_retried(tmp_path, store, monkeypatch):
    calls = []

    def denied(files):
        calls.append(1)
        raise ClientError(
            {
                "Error": {"Code": "AccessDenied", "Message": "Access Denied"},
                "ResponseMetadata": {"HTTPStatusCode": 403},
            },
            "PutObject",
        )

    monkeypatch.setattr(store.backend, "upload_files", denied)
    with pytest.raises(StorageError, match="AccessDenied"):
        commit_step(store, tmp_path, 1)
    assert calls == [1]


# --- Every checkpoint broken -------------------------------------------------------------------------------------


def test_auto_refuses_when_every_checkpoint_fails_verification_unless_fresh_start(tmp_path, root, store):
    for step in (1, 2, 3):
        commit_step(store, tmp_path, step)
    for step in (1, 2, 3):
        flip_byte(root / f"step-{step}" / SHARD)
    broken = {step: (root / f"step-{step}" / SHARD).read_bytes() for step in (1, 2, 3)}

    with pytest.raises(CheckpointError, match="no checkpoint .* can be resumed") as refused:
        store.resolve("auto")
    assert "\n" not in str(refused.value)
    assert store.resolve("auto", fresh_start=True) is None

    # The fresh run commits steps 1..5 with keep_last=2: the broken ones are neither pruned nor overwritten.
    store.claim("fresh-run", take_over=True)
    for step in range(1, 6):
        store.commit(
            stage_checkpoint(tmp_path / f"fresh-{step}", seed=100 + step),
            step,
            world_size=2,
            config_hash="c",
            run_id="fresh-run",
        )
        store.prune(CheckpointConfig(keep_last=2), run_id="fresh-run")
    assert store.list_steps() == [4, 5]
    set_aside = sorted(path.name for path in root.iterdir() if path.name.startswith("set-aside-"))
    assert [name.split("-")[3] for name in set_aside] == ["1", "2", "3"]
    for name in set_aside:
        assert (root / name / SHARD).read_bytes() == broken[int(name.split("-")[3])]


def test_prune_never_deletes_a_step_that_failed_verification(tmp_path, root, store):
    for step in range(1, 6):
        commit_step(store, tmp_path, step)
    flip_byte(root / "step-2" / SHARD)
    with pytest.raises(CheckpointError):
        store.resolve(2)
    assert store.prune(CheckpointConfig(keep_last=2)) == [1, 3]
    assert store.list_steps() == [2, 4, 5]


# --- Ownership ---------------------------------------------------------------------------------------------------


def test_a_root_belongs_to_the_run_that_first_committed_there(tmp_path, root, store):
    store.commit(stage_checkpoint(tmp_path / "a1", seed=1), 1, world_size=2, config_hash="c", run_id="run-a")
    other = CheckpointConfig(uri=str(root)).build()  # a second process
    with pytest.raises(RootClaimedError, match="belongs to run run-a") as refused:
        other.commit(stage_checkpoint(tmp_path / "b1", seed=2), 1, world_size=2, config_hash="c", run_id="run-b")
    assert "\n" not in str(refused.value)
    assert store.owner() == "run-a" and store.read_manifest(1).run_id == "run-a"
    store.verify(1)  # run B wrote nothing
    # The same run (a restart resuming with the id from its manifest) goes on committing.
    other.commit(stage_checkpoint(tmp_path / "a2", seed=3), 2, world_size=2, config_hash="c", run_id="run-a")
    assert store.list_steps() == [1, 2]


def test_only_the_first_of_two_racing_claims_wins(tmp_path, root):
    stores = [CheckpointConfig(uri=str(root)).build() for _ in range(2)]
    stores[0].claim("run-a")
    with pytest.raises(RootClaimedError):
        stores[1].claim("run-b")
    stores[1].claim("run-a")  # idempotent for the owner
    assert json.loads((root / "owner.json").read_text())["run_id"] == "run-a"


def test_prune_never_deletes_another_runs_steps(tmp_path, root, store):
    for step in (1, 2, 3):
        store.commit(
            stage_checkpoint(tmp_path / f"a{step}", seed=step), step, world_size=2, config_hash="c", run_id="run-a"
        )
    store.claim("run-b", take_over=True)
    for step in (4, 5, 6, 7):
        store.commit(
            stage_checkpoint(tmp_path / f"b{step}", seed=step), step, world_size=2, config_hash="c", run_id="run-b"
        )
    assert store.prune(CheckpointConfig(keep_last=2), run_id="run-b") == [4, 5]
    assert store.list_steps() == [1, 2, 3, 6, 7]


def test_auto_never_resumes_a_step_of_the_run_the_root_was_taken_over_from(tmp_path, root, store):
    for step in (1, 3):
        store.commit(
            stage_checkpoint(tmp_path / f"a{step}", seed=step), step, world_size=2, config_hash="c", run_id="run-a"
        )
    store.claim("run-b", take_over=True)
    for step in (2, 4):
        store.commit(
            stage_checkpoint(tmp_path / f"b{step}", seed=step), step, world_size=2, config_hash="c", run_id="run-b"
        )
    flip_byte(root / "step-4" / SHARD)
    assert store.resolve("auto") == 2  # not run A's step 3, although it is newer and verifies


# --- Per-rank commits --------------------------------------------------------------------------------------------


RANK_FILES = {
    0: {
        "engine/mp_rank_00_model_states.pt": 300,
        "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt": 500,
        "pipeline_state_rank0.pt": 50,
    },
    1: {"engine/zero_pp_rank_1_mp_rank_00_optim_states.pt": 500, "pipeline_state_rank1.pt": 50},
}


def stage_rank(tmp_path: Path, rank: int, step: int) -> Path:
    directory = tmp_path / f"node{rank}-step{step}"  # each rank's own disk: nothing shared
    return stage_checkpoint_files(directory, RANK_FILES[rank], seed=10 * step + rank)


def stage_checkpoint_files(directory: Path, files: dict[str, int], seed: int) -> Path:
    generator = random.Random(seed)
    for relpath, size in files.items():
        (directory / relpath).parent.mkdir(parents=True, exist_ok=True)
        (directory / relpath).write_bytes(generator.randbytes(size))
    return directory


def test_each_rank_uploads_its_own_files_and_the_committer_writes_the_manifest(tmp_path, root, store):
    store.begin_step(3, run_id="run-a")
    reported = {rank: store.upload_rank_files(3, rank, stage_rank(tmp_path, rank, 3)) for rank in (0, 1)}
    assert store.list_steps() == []  # uploaded, not committed
    manifest = store.commit_manifest(3, reported, world_size=2, config_hash="c", extra={"iteration": 3}, run_id="run-a")

    assert (manifest.world_size, manifest.run_id, store.latest_step()) == (2, "run-a", 3)
    store.download(3, tmp_path / "restored")
    for rank in (0, 1):
        for relpath in RANK_FILES[rank]:
            original = tmp_path / f"node{rank}-step3" / relpath
            assert (tmp_path / "restored" / relpath).read_bytes() == original.read_bytes()
    assert sorted(path.name for path in root.iterdir()) == ["latest", "owner.json", "step-3"]


def test_the_manifest_is_refused_until_every_rank_reported_and_uploaded(tmp_path, root, store):
    store.begin_step(1)
    reported = {0: store.upload_rank_files(1, 0, stage_rank(tmp_path, 0, 1))}
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\]"):
        store.commit_manifest(1, reported, world_size=2, config_hash="c")
    # Rank 1 says it uploaded, but its file never reached this store (another node's local disk, say).
    rank1 = stage_rank(tmp_path, 1, 1)
    reported[1] = [file_entry(rank1 / relpath, relpath) for relpath in RANK_FILES[1]]
    with pytest.raises(CheckpointError, match="missing"):
        store.commit_manifest(1, reported, world_size=2, config_hash="c")
    assert store.list_steps() == [] and store.latest_step() is None
    reported[1] = reported[0][:1]
    with pytest.raises(CheckpointError, match="reported by ranks 0 and 1"):
        store.commit_manifest(1, reported, world_size=2, config_hash="c")


def test_a_crashed_attempts_leftovers_are_not_in_the_commit(tmp_path, root, store):
    store.begin_step(1)
    store.upload_rank_files(1, 0, stage_checkpoint_files(tmp_path / "crashed", {"stale.bin": 10}, seed=1))
    store.begin_step(1)  # the restarted attempt
    reported = {rank: store.upload_rank_files(1, rank, stage_rank(tmp_path, rank, 1)) for rank in (0, 1)}
    store.commit_manifest(1, reported, world_size=2, config_hash="c")
    assert not (root / "step-1" / "stale.bin").exists()
    store.verify(1)


def test_check_committed_reads_manifests_only_and_refuses_what_cannot_load(tmp_path, root, store, monkeypatch):
    with pytest.raises(CheckpointError, match="no committed checkpoint in"):
        store.check_committed("auto")
    commit_step(store, tmp_path, 3)
    flip_byte(root / "step-3" / SHARD)  # only verifying would see it: the load does, this check must not hash
    monkeypatch.setattr(store.backend, "sha256", lambda keys: pytest.fail("hashed"))
    assert store.check_committed("auto") is None and store.check_committed("step-3") == 3
    with pytest.raises(CheckpointError, match="step-4 is not a committed checkpoint"):
        store.check_committed(4)
    with pytest.raises(CheckpointError, match="is not 'auto'"):
        store.check_committed("latest")
