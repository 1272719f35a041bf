"""The commit protocol: :class:`CheckpointStore` commits, verifies, finds, fetches and prunes ``step-N``
checkpoints under one root, through a backend (``local_store.LocalBackend`` or ``s3_store.S3Backend``) that only
moves bytes.

A step counts as committed only when its manifest exists, so a crash at any point of a commit leaves either the
previous state or a complete checkpoint, never a committed-but-broken one; ``latest`` moves only after the manifest
is written. Two ways to commit:

- one folder all ranks wrote (a node-local disk for one node, shared storage for several):
  :meth:`CheckpointStore.commit` once, after a barrier;
- no shared filesystem (several nodes): the committer calls :meth:`~CheckpointStore.begin_step`, every rank
  :meth:`~CheckpointStore.upload_rank_files` for its own files (hashed locally, so nothing is read back), and after
  a gather of what each rank reported the committer calls :meth:`~CheckpointStore.commit_manifest`, which checks that
  every rank reported and every file is in the store with its size before it writes the manifest.

Ownership: a root belongs to one run. The first commit claims it (``owner.json``, created atomically); another run
committing there is refused with one line, unless it explicitly takes the root over (a fresh start). Pruning only
ever deletes steps the pruning run wrote, never one that failed verification, and a commit over such a step moves
the old one aside first.

Outages: botocore retries each request; a commit additionally retries as a whole, with backoff, for
``outage_retry_s``, then raises :class:`core.errors.StoreUnavailable` (exit 75: restart and resume). The caller keeps
its local staging. Reads (resolve, verify, download) raise StoreUnavailable at once after botocore's retries: an
unreachable store is never mistaken for a broken checkpoint. Every message passes through
:func:`core.secrets.mask_uri`, so an endpoint URL carrying ``user:pass@`` (botocore puts the URL in its connection
errors) is masked.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from sage_grpo.core.errors import StoreUnavailable, UserError, first_line, is_outage
from sage_grpo.core.files import sha256_and_size
from sage_grpo.core.secrets import mask_uri
from sage_grpo.core.storage.locations import same_location
from sage_grpo.core.storage.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    OWNER_NAME,
    SET_ASIDE,
    STEP_NAME,
    CheckpointError,
    FileEntry,
    Manifest,
    best_step,
    file_entry,
    raise_if_problems,
    size_problems,
    staged_files,
    step_dir,
)
from sage_grpo.core.storage.s3_store import remote_errors

if TYPE_CHECKING:
    from sage_grpo.core.storage.config import CheckpointConfig

logger = logging.getLogger(__name__)

_RETRY_FIRST_DELAY_S = 1.0
_RETRY_MAX_DELAY_S = 30.0

T = TypeVar("T")


class StorageError(UserError):
    """The store refused a request for a reason retrying cannot cure (access denied, no credentials)."""


class RootClaimedError(UserError):
    """The checkpoint root belongs to another run."""


class StorageBackend(Protocol):
    """Byte storage under one root, addressed by relative keys that the store has already checked."""

    uri: str

    def read_bytes(self, key: str) -> bytes | None: ...
    def write_bytes(self, key: str, data: bytes) -> None: ...
    def upload_files(self, files: Sequence[tuple[Path, str]]) -> None: ...
    def download_files(self, files: Sequence[tuple[str, Path]]) -> None: ...
    def sizes(self, prefix: str) -> dict[str, int]: ...
    def sha256(self, keys: Sequence[str]) -> dict[str, str]: ...
    def child_dirs(self) -> list[str]: ...
    def delete_key(self, key: str) -> None: ...
    def delete_tree(self, prefix: str) -> None: ...
    def move_tree(self, prefix: str, target: str) -> None: ...
    # Writes ``key`` only if it does not exist, atomically; False when it already did.
    def create_exclusive(self, key: str, data: bytes) -> bool: ...
    # The key prefix step N's files and manifest are assembled under, by every rank; seal_step makes it step-N.
    def incoming(self, step: int) -> str: ...
    def open_step(self, step: int) -> None: ...
    def seal_step(self, step: int) -> None: ...
    def abandon_step(self, step: int) -> None: ...


def _translated(what: str):
    """Methods of CheckpointStore raise StoreUnavailable or StorageError, never a raw botocore error."""

    def decorate(method):
        @functools.wraps(method)
        def translating(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except remote_errors() as error:
                raise self._translate(error, what) from None

        return translating

    return decorate


class CheckpointStore:
    """Commit, verify, find, fetch and prune ``step-N`` checkpoints under one root. Build one with
    :meth:`CheckpointConfig.build`."""

    def __init__(self, backend: StorageBackend, *, outage_retry_s: float = 300.0):
        self.backend = backend
        self.outage_retry_s = outage_retry_s
        # Steps that failed verification in this process: never pruned, moved aside (not replaced) by a commit.
        self._failed: set[int] = set()

    @property
    def uri(self) -> str:
        return self.backend.uri

    # --- Committing ----------------------------------------------------------------------------------------------

    def commit(
        self,
        local_dir: str | Path,
        step: int,
        *,
        world_size: int,
        config_hash: str,
        extra: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ) -> Manifest:
        """Copy every file under ``local_dir`` to ``step-N``, then its manifest, then move ``latest`` to ``step``.

        Call it once, after every rank has finished writing ``local_dir``: the hashes are taken from what is there
        now. ``run_id`` claims the root for that run (RootClaimedError when another run owns it). On any error the
        step stays uncommitted and ``latest`` unchanged; an outage is retried for ``outage_retry_s`` and then raised
        as StoreUnavailable. ``local_dir`` is never modified: the caller keeps it until the commit returns.
        """
        staged = staged_files(Path(local_dir))
        entries = [file_entry(source, relpath) for source, relpath in staged]

        def attempt() -> Manifest:
            self._begin(step, run_id)  # outside the try: a refused claim must not clean up the owner's staging
            try:
                self._upload(step, staged)
                return self._seal(
                    step, entries, world_size=world_size, config_hash=config_hash, extra=extra, run_id=run_id
                )
            except BaseException:
                self.backend.abandon_step(step)
                raise

        return self._retrying(f"committing {step_dir(step)}", attempt)

    def begin_step(self, step: int, *, run_id: str | None = None) -> None:
        """Per-rank commits, first call (committer only, before any rank uploads): claim the root for ``run_id``,
        move aside a ``step-N`` that failed verification or another run wrote, and uncommit ``step-N``."""
        self._retrying(f"opening {step_dir(step)}", lambda: self._begin(step, run_id))

    def upload_rank_files(self, step: int, rank: int, local_dir: str | Path) -> list[FileEntry]:
        """Per-rank commits, every rank, after :meth:`begin_step`: upload the files under ``local_dir`` (paths
        relative to it, unique across ranks) into step N; return their entries for :meth:`commit_manifest`."""
        staged = staged_files(Path(local_dir))
        entries = [file_entry(source, relpath) for source, relpath in staged]
        self._retrying(f"uploading rank {rank}'s files of {step_dir(step)}", lambda: self._upload(step, staged))
        return entries

    def commit_manifest(
        self,
        step: int,
        rank_files: Mapping[int, Sequence[FileEntry]],
        *,
        world_size: int,
        config_hash: str,
        extra: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ) -> Manifest:
        """Per-rank commits, committer, after every rank's :meth:`upload_rank_files` returned: check that ranks
        ``0..world_size-1`` all reported, that no path was reported twice and that every file is in the store with
        its reported size; then write the manifest (sizes and sha256 as the ranks hashed them) and move ``latest``."""
        missing = sorted(set(range(world_size)) - set(rank_files))
        if missing:
            raise CheckpointError(f"{self.uri}/{step_dir(step)}: no files reported by rank(s) {missing}")
        owners: dict[str, int] = {}
        for rank, entries in sorted(rank_files.items()):
            for entry in entries:
                if entry.path in owners:
                    raise CheckpointError(
                        f"{self.uri}/{step_dir(step)}: {entry.path} reported by ranks {owners[entry.path]} and {rank}"
                    )
                owners[entry.path] = rank
        entries = sorted((entry for files in rank_files.values() for entry in files), key=lambda entry: entry.path)
        return self._retrying(
            f"committing {step_dir(step)}",
            lambda: self._seal(
                step, entries, world_size=world_size, config_hash=config_hash, extra=extra, run_id=run_id
            ),
        )

    # --- Ownership -----------------------------------------------------------------------------------------------

    @_translated("reading the owner")
    def owner(self) -> str | None:
        """The run id that owns this root, None before the first claim."""
        data = self.backend.read_bytes(OWNER_NAME)
        if data is None:
            return None
        try:
            return str(json.loads(data)["run_id"])
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(
                f"{self.uri}/{OWNER_NAME} is unreadable: refusing to guess which run owns this checkpoint root"
            ) from None

    @_translated("claiming the root")
    def claim(self, run_id: str, *, take_over: bool = False) -> None:
        """Make this root ``run_id``'s. Another run's root is refused with RootClaimedError unless ``take_over``
        (a deliberate fresh start); that run's steps stay, and this run's pruning never deletes them."""
        if not run_id:
            raise ValueError("a run id is a non-empty string")
        record = json.dumps({"run_id": run_id, "claimed": datetime.now(UTC).isoformat()}).encode()
        if take_over:
            previous = self.owner() if self.backend.read_bytes(OWNER_NAME) is not None else None
            self.backend.write_bytes(OWNER_NAME, record)
            if previous not in (None, run_id):
                logger.warning("%s taken over by run %s from run %s; its steps are kept", self.uri, run_id, previous)
            return
        created = self.backend.create_exclusive(OWNER_NAME, record)
        # Read back even after a successful create: a store that ignores conditional writes shows the last writer.
        owner = self.owner()
        if owner != run_id:
            raise RootClaimedError(
                f"checkpoint root {self.uri} belongs to run {owner}: give this run its own "
                "checkpoint.uri, or continue that run with --resume auto"
            )
        if created:
            logger.info("checkpoint root %s claimed by run %s", self.uri, run_id)

    # --- Reading -------------------------------------------------------------------------------------------------

    @_translated("reading a manifest")
    def read_manifest(self, step: int) -> Manifest:
        where = f"{self.uri}/{step_dir(step)}"
        data = self.backend.read_bytes(f"{step_dir(step)}/{MANIFEST_NAME}")
        if data is None:
            raise CheckpointError(f"{where} is not a committed checkpoint (no {MANIFEST_NAME})")
        manifest = Manifest.parse(data, where)
        if manifest.step != step:
            raise CheckpointError(f"{where}: manifest says step {manifest.step}")
        return manifest

    @_translated("verifying a checkpoint")
    def verify(self, step: int) -> Manifest:
        """The step's manifest if every file it lists exists with its recorded size and sha256; else CheckpointError."""
        try:
            manifest = self.read_manifest(step)
            prefix = step_dir(step)
            problems = size_problems(manifest, self.backend.sizes(prefix))
            to_hash = [entry for entry in manifest.files if entry.path not in problems]
            hashes = self.backend.sha256([f"{prefix}/{entry.path}" for entry in to_hash])
            for entry in to_hash:
                if hashes[f"{prefix}/{entry.path}"] != entry.sha256:
                    problems[entry.path] = "sha256 mismatch"
            raise_if_problems(f"{self.uri}/{prefix}", problems)
        except CheckpointError:
            self._failed.add(step)
            raise
        return manifest

    @_translated("downloading a checkpoint")
    def download(self, step: int, local_dir: str | Path) -> Manifest:
        """Fetch committed step ``step`` into ``local_dir``, checking the size and sha256 of every file fetched."""
        manifest = self.read_manifest(step)
        prefix = step_dir(step)
        where = f"{self.uri}/{prefix}"
        # Sizes first, so that a visibly broken checkpoint fails before gigabytes are transferred.
        raise_if_problems(where, size_problems(manifest, self.backend.sizes(prefix)))
        local_dir = Path(local_dir)
        for entry in manifest.files:
            (local_dir / entry.path).parent.mkdir(parents=True, exist_ok=True)
        self.backend.download_files([(f"{prefix}/{entry.path}", local_dir / entry.path) for entry in manifest.files])
        problems = {
            entry.path: "downloaded copy differs from the manifest"
            for entry in manifest.files
            if sha256_and_size(local_dir / entry.path) != (entry.sha256, entry.size)
        }
        raise_if_problems(where, problems)
        return manifest

    @_translated("listing checkpoints")
    def list_steps(self) -> list[int]:
        """Committed steps (those with a manifest, not necessarily verified), oldest first."""
        names = (STEP_NAME.fullmatch(name) for name in self.backend.child_dirs())
        steps = sorted(int(match.group(1)) for match in names if match)
        return [step for step in steps if self.backend.read_bytes(f"{step_dir(step)}/{MANIFEST_NAME}") is not None]

    @_translated("reading latest")
    def latest_step(self) -> int | None:
        """The step ``latest`` names, None when there is no ``latest`` or it holds no step number (damaged)."""
        data = self.backend.read_bytes(LATEST_NAME)
        text = (data or b"").decode(errors="replace").strip()
        return int(text) if re.fullmatch(r"[0-9]+", text) else None

    def check_committed(self, checkpoint: str | int) -> int | None:
        """CheckpointError now unless ``checkpoint`` (as for :meth:`resolve`) can load: the step it names is committed,
        or for ``"auto"`` some step is. From the manifests alone, nothing hashed or downloaded, so a command refuses in
        a second what it would otherwise refuse after building a model. Returns the named step; None for ``"auto"``,
        whose step is chosen when the steps are verified."""
        if checkpoint == "auto":
            if not self.list_steps():
                raise CheckpointError(f"no committed checkpoint in {self.uri}")
            return None
        step = self._requested_step(checkpoint)
        self.read_manifest(step)
        return step

    def resolve_without(self, step: int, *, fresh_start: bool = False) -> int | None:
        """``resolve("auto")`` once more after the reader found step ``step`` wrong (its states, or its manifest's
        content): the step is treated as failing verification (kept, never pruned, moved aside before its number is
        committed again) and the newest older verified step is returned."""
        self._failed.add(step)
        return self.resolve("auto", fresh_start=fresh_start)

    def resolve(self, resume: str | int, *, fresh_start: bool = False) -> int | None:
        """The step to resume from.

        ``"auto"``: the ``latest`` step if it verifies, else the newest older one that does (logged), else None when
        there is no checkpoint. When checkpoints exist but every one fails verification, CheckpointError, unless
        ``fresh_start`` (then None: the broken checkpoints are kept, never pruned).
        A step number, ``"step-N"`` or a URI of a step under this root: that step, or CheckpointError when it is
        not committed or fails verification; a requested checkpoint is never silently replaced.
        """
        if resume == "auto":
            return self._newest_verified(fresh_start)
        step = self._requested_step(resume)
        self.verify(step)
        return step

    # --- Retention -----------------------------------------------------------------------------------------------

    def prune(self, retention: CheckpointConfig, *, run_id: str | None = None) -> list[int]:
        """Delete committed steps except the last ``retention.keep_last`` (never fewer than two, which
        ``CheckpointConfig`` checks: the newest checkpoint can still turn out corrupt when it is read back, and one
        older one must survive it), the best by ``manifest.extra[retention.best_metric]`` and ``latest``; return the
        deleted steps. With ``run_id`` only that run's steps are considered (another run's,
        and old manifests without a run id, are never deleted). Uncommitted (in-flight) steps, steps that failed
        verification and steps with an unreadable manifest are never touched. A failed deletion or an unreachable
        store is logged, not raised: pruning is housekeeping and must not stop training."""
        try:
            manifests = self._readable_manifests(self.list_steps())
            ours = {
                step: manifest
                for step, manifest in manifests.items()
                if step not in self._failed and (run_id is None or manifest.run_id == run_id)
            }
            keep = set(sorted(ours)[-retention.keep_last :]) | {self.latest_step()}
        except (StoreUnavailable, StorageError) as error:
            logger.warning("not pruning %s: %s", self.uri, error)
            return []
        if retention.best_metric is not None:
            keep.add(best_step(ours, retention.best_metric, retention.higher_is_better))
        return [step for step in sorted(ours) if step not in keep and self._delete_step(step)]

    # --- Internals -----------------------------------------------------------------------------------------------

    def _begin(self, step: int, run_id: str | None) -> None:
        if run_id is not None:
            self.claim(run_id)
        self._set_aside_unless_ours(step, run_id)
        self.backend.open_step(step)

    def _upload(self, step: int, staged: Sequence[tuple[Path, str]]) -> None:
        prefix = self.backend.incoming(step)
        self.backend.upload_files([(source, f"{prefix}/{relpath}") for source, relpath in staged])

    def _seal(
        self,
        step: int,
        entries: Sequence[FileEntry],
        *,
        world_size: int,
        config_hash: str,
        extra: Mapping[str, Any] | None,
        run_id: str | None,
    ) -> Manifest:
        prefix = self.backend.incoming(step)
        manifest = Manifest(
            step=step,
            world_size=world_size,
            config_hash=config_hash,
            created=datetime.now(UTC),
            files=tuple(entries),
            extra=dict(extra or {}),
            run_id=run_id,
        )
        present = self.backend.sizes(prefix)
        raise_if_problems(f"{self.uri}/{step_dir(step)} (uploaded)", size_problems(manifest, present))
        listed = {entry.path for entry in entries}
        for stale in sorted(set(present) - listed - {MANIFEST_NAME}):  # left by a crashed attempt
            self.backend.delete_key(f"{prefix}/{stale}")
        # Last: until the manifest exists, nothing treats this step as a checkpoint.
        self.backend.write_bytes(f"{prefix}/{MANIFEST_NAME}", manifest.model_dump_json(indent=1).encode())
        self.backend.seal_step(step)
        self._failed.discard(step)  # what failed is set aside; this step N is a new, complete one
        self.backend.write_bytes(LATEST_NAME, f"{step}\n".encode())
        total = sum(entry.size for entry in manifest.files)
        logger.info("committed %s/%s: %d files, %d bytes", self.uri, step_dir(step), len(manifest.files), total)
        return manifest

    def _set_aside_unless_ours(self, step: int, run_id: str | None) -> None:
        """A committed step N about to be replaced is moved aside if it failed verification or is not this run's:
        neither may be deleted. Leftovers of an uncommitted attempt (no manifest) are simply replaced."""
        if self.backend.read_bytes(f"{step_dir(step)}/{MANIFEST_NAME}") is None:
            return
        reason = "it failed verification" if step in self._failed else None
        if reason is None:
            try:
                owner = self.read_manifest(step).run_id
            except CheckpointError as error:
                reason = str(error)
            else:
                if run_id is not None and owner != run_id:
                    reason = f"run {owner} wrote it"
        if reason is not None:
            target = f"{SET_ASIDE}{step_dir(step)}-{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
            self.backend.move_tree(step_dir(step), target)
            logger.warning("moved %s/%s aside to %s before replacing it: %s", self.uri, step_dir(step), target, reason)

    def _newest_verified(self, fresh_start: bool) -> int | None:
        steps, pointer = self.list_steps(), self.latest_step()
        damaged = pointer not in steps and self.backend.read_bytes(LATEST_NAME) is not None
        if damaged:
            # Not a pointer this store wrote (it moves only onto a committed step, which pruning keeps): trusting it
            # would hide every step, and a fresh start would then recompute and replace the verified ones.
            pointer = None
        # Steps after the pointer are skipped: they are either a commit whose pointer write was lost in a crash or
        # the abandoned branch of a run that was restarted from an older step; resuming one could mix timelines.
        candidates = [step for step in reversed(steps) if pointer is None or step <= pointer]
        owner = self.owner()
        for step in candidates:
            if step in self._failed:
                continue  # set aside by the caller, which said why
            try:
                written_by = self.verify(step).run_id
            except CheckpointError as error:
                logger.warning("skipping checkpoint %s/%s: %s", self.uri, step_dir(step), error)
                continue
            if owner is not None and written_by not in (None, owner):
                # Left by the run this root was taken over from: resuming it would splice two runs together.
                logger.warning(
                    "skipping checkpoint %s/%s: written by run %s, not by the owner %s",
                    self.uri,
                    step_dir(step),
                    written_by,
                    owner,
                )
                continue
            if damaged:
                logger.warning(
                    "resuming from %s/%s, the newest verified checkpoint: %s/%s names no committed step, ignored",
                    self.uri,
                    step_dir(step),
                    self.uri,
                    LATEST_NAME,
                )
            elif step != pointer:
                logger.log(
                    # The step latest names was already reported when it was skipped.
                    logging.INFO if pointer in self._failed else logging.WARNING,
                    "resuming from %s/%s, the newest verified checkpoint (latest was %s)",
                    self.uri,
                    step_dir(step),
                    pointer,
                )
            else:
                logger.info("resuming from %s/%s", self.uri, step_dir(step))
            return step
        if candidates and not fresh_start:
            raise CheckpointError(
                f"no checkpoint under {self.uri} can be resumed: steps {sorted(candidates)} fail "
                "verification (they are kept); start over only deliberately: --fresh-start"
            )
        if candidates:
            logger.warning("no checkpoint under %s can be resumed; starting fresh as asked, keeping them", self.uri)
        else:
            logger.info("no checkpoint under %s; starting from scratch", self.uri)
        return None

    def _requested_step(self, resume: str | int) -> int:
        if isinstance(resume, int):
            return resume
        text = resume.strip()
        if re.fullmatch(r"[0-9]+", text):
            return int(text)
        parent, _, name = text.rstrip("/").rpartition("/")
        match = STEP_NAME.fullmatch(name)
        if match and (not parent or same_location(parent, self.uri)):
            return int(match.group(1))
        raise CheckpointError(
            f"resume {mask_uri(str(resume))!r} is not 'auto', a step number or a step-N checkpoint under {self.uri}"
        )

    def _readable_manifests(self, steps: Sequence[int]) -> dict[int, Manifest]:
        manifests = {}
        for step in steps:
            try:
                manifests[step] = self.read_manifest(step)
            except CheckpointError as error:
                logger.warning("leaving %s/%s alone: %s", self.uri, step_dir(step), error)
        return manifests

    def _delete_step(self, step: int) -> bool:
        housekeeping_failures: tuple[type[BaseException], ...] = (OSError, *remote_errors())
        try:
            # Manifest first: a half-deleted step is then an uncommitted one, never a broken committed one.
            self.backend.delete_key(f"{step_dir(step)}/{MANIFEST_NAME}")
            self.backend.delete_tree(step_dir(step))
        except housekeeping_failures as error:  # pruning logs these instead of stopping a training run
            logger.warning("could not delete %s/%s: %s", self.uri, step_dir(step), first_line(error))
            return False
        logger.info("pruned %s/%s", self.uri, step_dir(step))
        return True

    def _retrying(self, what: str, action: Callable[[], T]) -> T:
        """``action()``, repeated with backoff while the store is unreachable, for at most ``outage_retry_s``."""
        delay, deadline = _RETRY_FIRST_DELAY_S, time.monotonic() + self.outage_retry_s
        while True:
            try:
                return action()
            except remote_errors() as error:
                if not is_outage(error) or time.monotonic() + delay > deadline:
                    raise self._translate(error, what) from None
                line = first_line(error)
                logger.warning("%s unreachable while %s (%s); retrying in %.0f s", self.uri, what, line, delay)
            except StoreUnavailable as error:  # from a translated read inside the action
                if time.monotonic() + delay > deadline:
                    raise
                logger.warning("%s; retrying in %.0f s", error, delay)
            time.sleep(delay)
            delay = min(2 * delay, _RETRY_MAX_DELAY_S)

    def _translate(self, error: BaseException, what: str) -> Exception:
        line = first_line(error)
        if is_outage(error):
            return StoreUnavailable(f"checkpoint store {self.uri} unavailable while {what}: {line}")
        return StorageError(f"checkpoint store {self.uri} refused {what}: {line}")
