"""The scheduled fine-tuning run: newest prompt set -> train -> promote, safe to start any number of times.

Layout under the checkpoint root (a local folder or ``s3://bucket/prefix``)::

    ROOT/sage-2026-12-03/                   one scheduled run, named by the day it started; its checkpoints live here
    ROOT/sage-2026-12-03/schedule/prompt_set    the prompt set the run started with (a resumed run keeps it)
    ROOT/sage-2026-12-03/schedule/train.done    one marker per finished step, written only after the step exits 0
    ROOT/sage-2026-12-03/schedule/train.failed  a step that exited 2 or 3 (see below): the run is not resumed

Steps: ``train`` runs ``sagegrpo run`` with ``registry.model_name`` set to ``--model`` and ``registry.promote=false``:
a completed run evaluates its final policy on the held-out prompts, exports it and registers it as the model's
``challenger`` with the eval metrics as tags. ``promote`` then runs the gate of the config's ``registry`` section
(primary metric, margin, guards) on the challenger against the ``champion``, on the run's tracking server. Runs
started before this layout also have an ``evaluate`` step marker; it is ignored (the run-end publish evaluates).
Both steps run with this interpreter (``python -m``: cron's PATH need not hold the venv) and receive the same config,
overrides and environment, so they resolve the same tracking server. The schedule's own S3 calls (markers, the
prompts listing) use the run's ``s3`` settings, as its checkpoints and ingest do; an unreachable store stops the
schedule with exit 75 (retryable), nothing started.

The registry outlives each run, so the config must name a shared MLflow server (``tracking.tracking_uri`` or
``MLFLOW_TRACKING_URI``); a run's embedded store would hold one version each day and promote every one of them. The
gate compares like with like only, so the config must also name a fixed evaluation set (``eval.source``): each day's
held-out split differs, and every challenger would be "not comparable". Both are checked, with the rest of the config
and the prompt set itself (read as training will read it), before anything starts: a broken newest prompt set starts
no run, and a later good one is trained when it arrives.

Decision (``decide``, pure): an unfinished scheduled run is finished first, from its first step without a marker
(training always passes ``--resume auto``, so a half-trained run continues from its newest committed checkpoint);
otherwise, if today's run is complete, or the newest prompt set was already trained by an earlier run, there is
nothing to do; otherwise a new run named by today's date starts on the newest prompt set. Starting twice the same
day therefore never trains twice. Two invocations at the same time
are not guarded against here: the CronJob uses ``concurrencyPolicy: Forbid`` and infra/scheduled_run.sh a flock.

Prompt sets are the prompt files directly under the prompts location (``.txt``, ``.jsonl`` or ``.csv``, what
``data.source`` reads); the newest is the greatest name, so name them by date (``2026-12-03.jsonl``). Names starting
with ``.`` or ``_`` (uploads in progress, markers) are ignored.

A step that fails stops the run with that step's exit status, so a training run stopped with 75 (checkpointed,
restart me) reaches the scheduler as 75 and the next start resumes it. A step that exits 2 (a user error: a bad
config combination, scores the gate cannot compare) or 3 (the hacking guard stopped the run) would end the same way
on every start, so it is marked ``schedule/<step>.failed`` (with its status) and the run counts as finished: the next
start does not retry it but trains the next prompt set when one arrives. Delete the marker to retry the run after
fixing what it said.

Training runs ``--nproc-per-node`` processes, by default one per GPU of this node (torchrun's ``gpu``), 1 without one.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any, Literal

from botocore.exceptions import BotoCoreError, ClientError

from sage_grpo.core.errors import StoreUnavailable, UserError, first_line, is_outage
from sage_grpo.core.s3 import s3_client
from sage_grpo.core.secrets import mask_uri

STEPS = ("train", "promote")
# A step's exit statuses that a restart would only repeat: a user error (2), a run the hacking guard stopped (3,
# stages/evaluate.py HACKING_STOP_EXIT_CODE; importing it would load that stage's dependencies).
FINAL_STATUSES = (UserError.exit_code, 3)
RUN_PREFIX = "sage"
_RUN_NAME = re.compile(rf"^{RUN_PREFIX}-\d{{4}}-\d{{2}}-\d{{2}}$")


@dataclass(frozen=True)
class ScheduledRunOptions:
    """What ``sagegrpo schedule`` was asked to do (the command line's options)."""

    config: str
    prompts: str
    checkpoint_root: str
    model: str
    work_dir: str = "/cache/runs"
    nproc_per_node: int | None = None  # None: this node's GPU count, 1 without a GPU
    date: date | None = None
    dry_run: bool = False
    overrides: tuple[str, ...] = ()  # the user's key=value overrides, before the schedule's own


@dataclass(frozen=True)
class RunState:
    """What the checkpoint root says about one scheduled run."""

    name: str
    prompt_set: str | None
    completed: frozenset[str]
    failed: str | None = None  # "<step> exited <status>" when a step failed with a user error

    @property
    def done(self) -> bool:
        return self.completed >= set(STEPS) or self.failed is not None


@dataclass(frozen=True)
class Decision:
    action: Literal["new", "resume", "skip"]
    run_name: str
    prompt_set: str | None
    steps: tuple[str, ...]  # still to run, in order; empty for "skip"
    reason: str


def run_name(day: date) -> str:
    return f"{RUN_PREFIX}-{day.isoformat()}"


def newest_prompt_set(names: list[str]) -> str:
    candidates = [name.rstrip("/") for name in names if not name.startswith((".", "_"))]
    if not candidates:
        raise UserError("no prompt set found: the prompts location is empty")
    return max(candidates)


def decide(today: date, prompt_sets: list[str], runs: list[RunState]) -> Decision:
    """Which run to work on and which steps remain; see the module docstring for the rules."""
    scheduled = sorted((run for run in runs if _RUN_NAME.match(run.name)), key=lambda run: run.name)
    unfinished = [run for run in scheduled if not run.done]
    if unfinished:
        run = unfinished[-1]
        if run.prompt_set is None:
            raise UserError(f"run {run.name} has no schedule/prompt_set marker: it was not started by the scheduler")
        steps = tuple(step for step in STEPS if step not in run.completed)
        return Decision("resume", run.name, run.prompt_set, steps, f"{run.name} is unfinished: {', '.join(steps)} left")
    name = run_name(today)
    if any(run.name == name for run in scheduled):
        return Decision("skip", name, None, (), f"{name} is already complete")
    prompt_set = newest_prompt_set(prompt_sets)
    trained = [run for run in scheduled if run.prompt_set == prompt_set]
    if trained:
        last = trained[-1]
        how = f"tried by {last.name}, whose {last.failed}" if last.failed else f"trained by {last.name}"
        return Decision("skip", name, prompt_set, (), f"prompt set {prompt_set} was already {how}")
    return Decision("new", name, prompt_set, STEPS, f"new run {name} on prompt set {prompt_set}")


class Store:
    """Just enough of a file system for markers: a local folder or an S3 prefix, reached with ``open_s3()``'s
    client. S3 errors leave it as StoreUnavailable (unreachable: exit 75) or UserError (refused)."""

    def __init__(self, uri: str, open_s3: Callable[[], Any] = s3_client):
        self.uri = uri.rstrip("/")
        self._s3 = None
        if self.uri.startswith("s3://"):
            self._s3 = open_s3()
            self._bucket, _, self._prefix = self.uri[len("s3://") :].partition("/")

    def join(self, *parts: str) -> str:
        return "/".join([self.uri, *parts])

    def children(self, *parts: str) -> list[str]:
        """Names of the entries directly under ``parts`` (files and folders alike)."""
        if self._s3 is None:
            folder = Path(self.join(*parts))
            return sorted(child.name for child in folder.iterdir()) if folder.is_dir() else []
        prefix = self._key(*parts) + "/" if self._key(*parts) else ""
        names = set()
        pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=prefix, Delimiter="/")
        with self._translated("listing"):
            for page in pages:
                names.update(p["Prefix"][len(prefix) :].rstrip("/") for p in page.get("CommonPrefixes", []))
                names.update(o["Key"][len(prefix) :] for o in page.get("Contents", []) if o["Key"] != prefix)
        return sorted(names)

    def read(self, *parts: str) -> str | None:
        if self._s3 is None:
            path = Path(self.join(*parts))
            return path.read_text() if path.is_file() else None
        with self._translated("reading"):
            try:
                return self._s3.get_object(Bucket=self._bucket, Key=self._key(*parts))["Body"].read().decode()
            except self._s3.exceptions.NoSuchKey:
                return None

    def write(self, text: str, *parts: str) -> None:
        if self._s3 is None:
            path = Path(self.join(*parts))
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(path.name + ".tmp")
            temporary.write_text(text)
            temporary.replace(path)  # a marker is either absent or whole
        else:
            with self._translated("writing"):
                self._s3.put_object(Bucket=self._bucket, Key=self._key(*parts), Body=text.encode())

    def _key(self, *parts: str) -> str:
        return "/".join(part for part in (self._prefix, *parts) if part)

    @contextmanager
    def _translated(self, what: str):
        try:
            yield
        except (BotoCoreError, ClientError) as error:
            line = first_line(error)
            if is_outage(error):
                raise StoreUnavailable(f"{self.uri} unreachable while {what}: {line}") from None
            raise UserError(f"{self.uri} refused {what}: {line}") from None


def read_runs(root: Store) -> list[RunState]:
    runs = []
    for name in root.children():
        if not _RUN_NAME.match(name):
            continue
        markers = root.children(name, "schedule")
        prompt_set = root.read(name, "schedule", "prompt_set")
        completed = frozenset(step for step in STEPS if f"{step}.done" in markers)
        failed = next(
            (
                f"{step} {root.read(name, 'schedule', f'{step}.failed')}".strip()
                for step in STEPS
                if f"{step}.failed" in markers
            ),
            None,
        )
        runs.append(RunState(name, prompt_set.strip() if prompt_set else None, completed, failed))
    return runs


def run_overrides(decision: Decision, args: ScheduledRunOptions, root: Store) -> list[str]:
    """The config overrides that make training one scheduled run: its identity and checkpoints under the checkpoint
    root, outputs and caches on local disk, its prompt set, and registration of the result as the challenger."""
    return [
        *args.overrides,
        f"run.name={decision.run_name}",
        f"run.output_dir={Path(args.work_dir) / decision.run_name}",
        f"checkpoint.uri={root.join(decision.run_name)}/checkpoints",
        f"data.source={args.prompts.rstrip('/')}/{decision.prompt_set}",
        f"registry.model_name={args.model}",
        "registry.promote=false",
    ]


def step_command(step: str, decision: Decision, args: ScheduledRunOptions, root: Store) -> list[str]:
    """The command line of one step, both with this interpreter (no ``sagegrpo`` looked up on PATH) and the same
    overrides. Training runs under pipeline.launch so a checkpointed stop keeps status 75."""
    overrides = run_overrides(decision, args, root)
    if step == "train":
        return [
            sys.executable,
            "-m",
            "sage_grpo.pipeline.launch",
            "--standalone",
            f"--nproc-per-node={training_processes(args)}",
            "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1",
            "--shutdown-timeout=300",
            "--module",  # torchrun starts each worker as `sys.executable -m sage_grpo.pipeline.cli`
            "sage_grpo.pipeline.cli",
            "run",
            args.config,
            *overrides,
            "--resume",
            "auto",
        ]
    # The gate's settings and the tracking server come from the same config and overrides as the run's.
    return [
        sys.executable,
        "-m",
        "sage_grpo.pipeline.cli",
        "promote",
        "--config",
        args.config,
        "--model",
        args.model,
        *overrides,
    ]


def training_processes(args: ScheduledRunOptions) -> int:
    """``--nproc-per-node``, else one process per GPU of this node (torchrun's ``gpu``), else 1."""
    if args.nproc_per_node is not None:
        return args.nproc_per_node
    import torch

    return max(torch.cuda.device_count(), 1)


def check_config(decision: Decision, args: ScheduledRunOptions, root: Store) -> None:
    """The run config as training will see it, and the prompt set as training will read it, validated before any
    step starts (one line if either is wrong)."""
    from sage_grpo.pipeline.config import load_run_config
    from sage_grpo.stages.ingest import ingest

    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise UserError(f"schedule: --nproc-per-node must be >= 1, got {args.nproc_per_node}")
    config = load_run_config(args.config, run_overrides(decision, args, root))
    if not config.tracking.server_uri():
        raise UserError(
            f"{args.config}: the scheduled run needs tracking.tracking_uri (or MLFLOW_TRACKING_URI), a shared MLflow "
            "server: the model registry must outlive each run"
        )
    if not config.eval.source:
        raise UserError(
            f"{args.config}: the scheduled run needs eval.source, a fixed evaluation set: each day's held-out split "
            "differs, and the promotion gate compares only versions scored on the same set"
        )
    ingest(config.data, config.s3)  # a prompt set training would refuse starts no run


def stores(args: ScheduledRunOptions) -> tuple[Store, Store]:
    """The checkpoint root and the prompts location, reached with the run's own ``s3`` settings (the config's and the
    user's overrides; the prompts location stands in for data.source, which is the schedule's to set)."""
    from sage_grpo.pipeline.config import load_run_config

    config = load_run_config(args.config, [*args.overrides, f"data.source={args.prompts}"])
    return (
        Store(args.checkpoint_root, config.s3.client),
        Store(args.prompts, config.s3.client),
    )


def run_relaying_stop_signals(command: list[str]) -> int:
    """Run ``command`` and pass SIGTERM/SIGUSR1 on to it: in a pod only PID 1 (this process) receives them, and the
    step must see them to checkpoint. SIGINT is left alone, a terminal already sends it to the whole group."""
    child = subprocess.Popen(command)
    relay = lambda signum, frame: child.send_signal(signum)
    previous = {signum: signal.signal(signum, relay) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        return child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_scheduled(args: ScheduledRunOptions) -> int:
    root, prompts = stores(args)
    decision = decide(args.date or date.today(), prompts.children(), read_runs(root))
    print(f"schedule: {decision.action}: {decision.reason}", flush=True)
    if decision.steps:
        check_config(decision, args, root)
    if decision.action == "new" and not args.dry_run:
        root.write(decision.prompt_set + "\n", decision.run_name, "schedule", "prompt_set")
    for step in decision.steps:
        command = step_command(step, decision, args, root)
        print(f"schedule: {step}: {' '.join(map(mask_uri, command))}", flush=True)
        if args.dry_run:
            continue
        status = run_relaying_stop_signals(command)
        if status in FINAL_STATUSES:  # the same every time: finished, not to be resumed
            root.write(f"exited {status}", decision.run_name, "schedule", f"{step}.failed")
            print(
                f"schedule: {step} exited {status}; {decision.run_name} is marked failed and will not be resumed "
                f"(delete its schedule/{step}.failed to retry it)",
                file=sys.stderr,
            )
            return status
        if status != 0:
            print(f"schedule: {step} exited {status}; the next start resumes from this step", file=sys.stderr)
            return status
        root.write("", decision.run_name, "schedule", f"{step}.done")
    return 0
