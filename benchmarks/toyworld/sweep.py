"""The ToyWorld sweep through the front door: every arm is ``configs/toyworld.yaml`` plus ``key=value`` overrides, every
run one ``sagegrpo run`` of it (its own output folder and embedded MLflow store), and the numbers are read back from
that run's MLflow metrics: gold first (the judge, never trained on), then the proxy GRPO optimised.

    PYTHONPATH=. nice -n 10 python -m benchmarks.toyworld.sweep --arms 'kl dual' 'kl none' --seeds 3
    python -m benchmarks.toyworld.sweep --collect --arms 'kl dual' 'kl none' --seeds 3   # report the finished runs

One run at a time, one thread each (``OMP_NUM_THREADS`` defaults to 1). Each finished run is written to
``--out``/runs/ as JSON at once, so a rerun of the same command skips it and an interrupted sweep resumes; a run cut
short is started afresh. Refused before anything runs, in one line: two arms that are the same experiment, an arm that
is the first iterations of another (read the longer run's evaluation there instead), and a finished run measured on
other pretrained weights than the config's ``model.kwargs.sha256`` (results.json keeps that sha256). Then
``results.json`` is written and ``report.py`` regenerates the ToyWorld section of ``benchmarks/RESULTS.md`` from it.

The pretrained model's evaluation (iteration 0) is the run's own (``eval.at_start``); for a run without it, the sweep
takes it once per evaluation set and sampler schedule through the recipe's own ``evaluate`` and stores it beside the
runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sage_grpo.core.errors import UserError

REPOSITORY = Path(__file__).resolve().parents[2]
BASE_CONFIG = REPOSITORY / "configs" / "toyworld.yaml"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "sweep"  # results/ beside it: the retired loop's
DEFAULT_WORK = REPOSITORY / "runs" / "toyworld-sweep"  # checkpoints, MLflow stores, videos: never committed

# What the evaluations report, gold first. A judge is logged as eval/judge/<name>, a zero-weight reward as eval/<name>.
EVAL_METRICS = ("gold", "right_way", "static", "wrong_way", "reward", "TA", "VQ", "MQ")
# Per training iteration: the proxy on the training rollouts, the trust region, and the iteration's stage times.
TRAIN_METRICS = (
    "reward/mean",
    "reward/gold/mean",
    "update/kl",
    "update/lambda_kl",
    "update/kl_grad_ratio",
    "update/kl_grad_ratio/weight_space",
    "time/rollout",
    "time/score",
    "time/update",
)
STAGE_TIMES = ("time/rollout", "time/score", "time/update")
# Keys that cannot change what a run trains or measures: names, places, bookkeeping.
NOT_THE_EXPERIMENT = {
    "run": ("name", "output_dir", "time_budget_minutes", "preemption_grace_s"),
    "eval": ("write_videos",),
    "tracking": None,
    "checkpoint": None,
    "s3": None,
    "registry": None,
}


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...] = ()


FIXED_LAMBDA = 0.3  # where the calibrated controller held lambda at lr 1e-4 (docs/algorithm.md): the equalizer arms
_PINNED = tuple(f"trust_region.{key}={FIXED_LAMBDA}" for key in ("kl_initial", "kl_minimum", "kl_maximum"))
_MQ_ONLY = (
    "rewards=[{name: 'benchmarks.toyworld.rewards:ToyWorldReward', weights: {MQ: 1.0}},"
    " {name: 'benchmarks.toyworld.rewards:GoldJudge', weights: {}}]"
)
ARMS = {
    arm.name: arm
    for arm in [
        Arm("base"),  # SAGE, the moving trust region, lr 1e-4: configs/toyworld.yaml as it is
        *[Arm(f"kl {strategy}", (f"trust_region.strategy={strategy}",)) for strategy in ("none", "fixed", "step_wise")],
        Arm("kl dual", ("trust_region.strategy=dual",)),
        # Each sampler at its own exploration scale (shared/spec/sage-grpo.md); SAGE's is the base's.
        *[Arm(v, (f"sde.variant={v}", f"sde.eta={eta}")) for v, eta in (("dance", 0.25), ("flow", 0.7), ("cps", 0.5))],
        # The trust region against no KL across learning rates: is it more than a smaller lr?
        *[
            Arm(f"{strategy} lr {lr}", (f"trust_region.strategy={strategy}", f"update.learning_rate={lr}"))
            for strategy in ("none", "dual")
            for lr in ("3e-5", "3e-4")
        ],
        # Where the proxy is hackable: motion quality alone pays a static square in full (gold still reported).
        *[
            Arm(f"MQ proxy, kl {strategy}", (_MQ_ONLY, f"trust_region.strategy={strategy}"))
            for strategy in ("none", "dual")
        ],
        # Issue 40's cost lever: 2 trained steps instead of the base's 4 (cost_table's "2 trained steps" preset).
        Arm("window [0,2]", ("sde.window=[0,2]",)),
        # The equalizer at a fixed lambda, so that the controller cannot make up for it.
        *[
            Arm(f"equalizer {state} lambda {FIXED_LAMBDA:g}", (*_PINNED, f"update.equalizer={v}"))
            for state, v in (("on", "true"), ("off", "false"))
        ],
    ]
}


# ----------------------------------------------------------------------------------------------------------------
# Arms: what each one is, and which combinations are refused
# ----------------------------------------------------------------------------------------------------------------


def experiment(overrides: tuple[str, ...] | list[str], base: Path = BASE_CONFIG) -> dict:
    """The resolved run config of ``base`` + ``overrides`` without the keys that cannot change the training: two arms
    with the same ``experiment`` run the same thing at the same seed (``seed=`` is a run's, not an arm's)."""
    from sage_grpo.pipeline.config import load_run_config

    try:
        resolved = load_run_config(base, list(overrides)).model_dump(mode="json")
    except UserError as error:
        raise UserError(f"{' '.join(overrides) or base.name}: {error}") from None
    del resolved["seed"]
    for section, keys in NOT_THE_EXPERIMENT.items():
        for key in keys or list(resolved[section]):
            resolved[section].pop(key, None)
    return resolved


def check_arms(arms: dict[str, dict]) -> None:
    """Refuse (one line, naming both) two arms that are one experiment, or one that is another's first iterations:
    either would count one run as two pieces of evidence. ``arms``: name -> ``experiment``."""
    seen: dict[str, tuple[int, str]] = {}
    for name, resolved in arms.items():
        iterations = resolved["run"]["max_iterations"]
        rest = json.dumps({**resolved, "run": {**resolved["run"], "max_iterations": None}}, sort_keys=True)
        for other, (other_iterations, other_rest) in seen.items():
            if rest != other_rest:
                continue
            if iterations == other_iterations:
                raise UserError(f"arms '{other}' and '{name}' are the same experiment once defaults are resolved")
            short, long = (name, other) if iterations < other_iterations else (other, name)
            n = min(iterations, other_iterations)
            raise UserError(
                f"arm '{short}' is the first {n} iterations of arm '{long}': read '{long}' at iteration {n} instead"
            )
        seen[name] = (iterations, rest)


def weights_of(resolved: dict) -> str | None:
    """The pretrained weights' sha256 an arm's config pins (``model.kwargs.sha256``)."""
    return resolved["model"].get("kwargs", {}).get("sha256")


# ----------------------------------------------------------------------------------------------------------------
# Stored runs: resume and refusal
# ----------------------------------------------------------------------------------------------------------------


def run_path(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / f"{slug(arm)}-seed{seed}.json"


def slug(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9.=-]+", "_", name)


def finished(out: Path, arm: str, resolved: dict, seed: int) -> dict | None:
    """The stored result of this run if a sitting finished the same experiment; a stored run on other pretrained
    weights is refused rather than rerun over (its numbers are not this sweep's, and are not to be lost)."""
    path = run_path(out, arm, seed)
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    if stored.get("weights_sha256") != weights_of(resolved):
        raise UserError(
            f"{path} was measured on pretrained weights {stored.get('weights_sha256')}, this sweep's are "
            f"{weights_of(resolved)}: move that folder aside or restore those weights"
        )
    return stored if stored["experiment"] == resolved and stored["seed"] == seed else None


def join(results: dict, run: dict) -> dict:
    """``run`` added to ``results`` (results.json), refused if measured on other pretrained weights."""
    if run["weights_sha256"] != results["weights_sha256"]:
        raise UserError(
            f"run '{run['arm']}' seed {run['seed']} was measured on weights {run['weights_sha256']}, not this "
            f"sweep's {results['weights_sha256']}: it cannot join"
        )
    return {**results, "runs": [*results["runs"], run]}


def write_atomically(path: Path, text: str) -> None:
    """Write then rename: a sitting killed mid-write leaves no half file under the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


# ----------------------------------------------------------------------------------------------------------------
# One run: a `sagegrpo run` subprocess, its metrics read back from its MLflow store
# ----------------------------------------------------------------------------------------------------------------


def _environment() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def run_one(arm: Arm, seed: int, resolved: dict, work: Path, extra: tuple[str, ...] = ()) -> dict:
    """Train ``arm`` at ``seed`` with ``sagegrpo run`` and return its record: per-evaluation metrics from MLflow."""
    run_dir = work / slug(arm.name) / f"seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier attempt cut short: its run starts afresh
    run_dir.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "sage_grpo.pipeline.cli",
        "run",
        str(BASE_CONFIG),
        *arm.overrides,
        *extra,
        f"seed={seed}",
        f"run.output_dir={run_dir}",
        f"run.name=toyworld-{slug(arm.name)}-seed{seed}",
        # a checkpoint at every evaluation, all kept until drift.py has read them
        f"checkpoint.every={resolved['eval']['every']}",
        f"checkpoint.keep_last={resolved['run']['max_iterations']}",
    ]
    log = run_dir / "sweep.log"
    start = time.perf_counter()
    with log.open("w") as sink:
        code = subprocess.call(command, cwd=REPOSITORY, env=_environment(), stdout=sink, stderr=subprocess.STDOUT)
    wall_s = time.perf_counter() - start
    if code != 0:
        raise UserError(f"run '{arm.name}' seed {seed} exited {code}: see {log}")
    evaluations, history = read_back(run_dir / "mlflow.db")
    return {
        "arm": arm.name,
        "overrides": list(arm.overrides),
        "seed": seed,
        "experiment": resolved,
        "weights_sha256": weights_of(resolved),
        "command": shlex.join(["sagegrpo", *command[3:]]),
        "evaluations": evaluations,
        "history": history,
        "wall_s": wall_s,
        "train_s_per_iteration": sum(sum(h.get(k) or 0.0 for k in STAGE_TIMES) for h in history) / len(history),
    }


def with_drift(record: dict, run_dir: Path, out: Path) -> dict:
    """``record`` with each evaluation's KL from the start (``drift.py``), measured from the checkpoints in
    ``run_dir`` (then deleted: they are large and DeepSpeed's scripts in them are not ours) and written to ``--out``.
    A run whose checkpoints are gone keeps its record without drift; one missing an evaluation's checkpoint keeps
    them, and says so."""
    from .drift import drift_by_iteration

    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        drift = drift_by_iteration(run_dir, BASE_CONFIG)
        missing = [e["iteration"] for e in record["evaluations"] if e["iteration"] not in drift]
        if missing:
            print(f"{run_dir}: no checkpoint at iteration(s) {missing}: drift not recorded, checkpoints kept")
        else:
            for evaluation in record["evaluations"]:
                evaluation["kl_from_start"] = drift[evaluation["iteration"]]
            shutil.rmtree(checkpoints)
    write_atomically(run_path(out, record["arm"], record["seed"]), json.dumps(record))
    return record


def brought_up_to_date(record: dict, arm: Arm, resolved: dict, seed: int, out: Path, work: Path, extra=()) -> dict:
    """A finished run's record with the start evaluation its arm reports now and its drift, where either was missing
    or wrong when it finished (drift only while its checkpoints are still there)."""
    start = start_evaluation(resolved, (*arm.overrides, *extra), out, work)
    first = record["evaluations"][0]
    stale = any(first.get(name) != value for name, value in start.items())
    if stale:
        record["evaluations"][0] = {**start, **({"kl_from_start": 0.0} if "kl_from_start" in first else {})}
    if "kl_from_start" not in record["evaluations"][-1]:
        return with_drift(record, work / slug(arm.name) / f"seed{seed}", out)
    if stale:
        write_atomically(run_path(out, arm.name, seed), json.dumps(record))
    return record


def read_back(store: Path) -> tuple[list[dict], list[dict]]:
    """The one run in an embedded MLflow store: its evaluations (gold first) and its per-iteration history."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store.resolve()}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(experiments)

    def series(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    evaluations: dict[int, dict] = {}
    for name in EVAL_METRICS:
        values = series(f"eval/judge/{name}") or series(f"eval/{name}")
        for step, value in values.items():
            evaluations.setdefault(step, {"iteration": step})[name] = value
    history: dict[int, dict] = {}
    for key in TRAIN_METRICS:
        for step, value in series(key).items():
            history.setdefault(step, {"iteration": step})[key] = value
    return [evaluations[s] for s in sorted(evaluations)], [history[s] for s in sorted(history)]


def start_identity(resolved: dict) -> dict:
    """What the pretrained model's evaluation depends on: the weights, the evaluation set and seed, the ODE's steps
    and shift, and the rewards (the proxy it reports). The sampler variant and the training keys do not enter."""
    return {
        "weights": weights_of(resolved),
        "eval": resolved["eval"],
        "steps": resolved["sde"]["steps"],
        "shift": resolved["sde"]["shift"],
        # only where they differ from the base's: its stored evaluation keeps the key it was filed under
        **({"rewards": resolved["rewards"]} if resolved["rewards"] != experiment(())["rewards"] else {}),
    }


def start_evaluation(resolved: dict, overrides: tuple[str, ...], out: Path, work: Path) -> dict:
    """The pretrained model's evaluation (iteration 0) through the recipe's ``evaluate``, once per evaluation
    setting (``start_identity``) and stored in ``--out``/runs/."""
    identity = start_identity(resolved)
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    path = out / "runs" / f"start-{key}.json"
    if path.exists():
        return json.loads(path.read_text())["evaluation"]
    run_dir = work / f"start-{key}"
    shutil.rmtree(run_dir, ignore_errors=True)
    code = (
        "import json, sys\n"
        "from sage_grpo.pipeline.config import load_run_config\n"
        "from sage_grpo.pipeline.recipe import SageGRPORecipe\n"
        "recipe = SageGRPORecipe(load_run_config(sys.argv[1], sys.argv[2:]))\n"
        "recipe.setup_policy(None)\n"
        "print(json.dumps(recipe.evaluate()))\n"
    )
    command = [sys.executable, "-c", code, str(BASE_CONFIG), *overrides, f"run.output_dir={run_dir}"]
    done = subprocess.run(command, cwd=REPOSITORY, env=_environment(), capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"the pretrained model's evaluation failed: {done.stderr.strip().splitlines()[-1:]}")
    metrics = json.loads(done.stdout.strip().splitlines()[-1])
    evaluation = {"iteration": 0}
    for name in EVAL_METRICS:
        value = metrics.get(f"eval/judge/{name}", metrics.get(f"eval/{name}"))
        if value is not None:
            evaluation[name] = value
    write_atomically(path, json.dumps({"identity": identity, "evaluation": evaluation}))
    return evaluation


# ----------------------------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------------------------


def plan(names: list[str], seeds: int, extra: tuple[str, ...] = ()) -> list[tuple[Arm, dict, int]]:
    """The jobs, seed by seed (a sweep cut short has the same seeds in every arm), after the refusals."""
    unknown = [name for name in names if name not in ARMS]
    if unknown:
        raise UserError(f"unknown arm {unknown[0]!r}; the arms: {', '.join(ARMS)}")
    resolved = {name: experiment((*ARMS[name].overrides, *extra)) for name in names}
    check_arms(resolved)
    return [(ARMS[name], resolved[name], seed) for seed in range(seeds) for name in names]


def check_weights(resolved: dict) -> str:
    """The sha256 of the cached pretrained weights, refused unless it is the one the config pins."""
    from .model import weights_sha256
    from .pretrain import cached_weights, pretrain_config

    path = cached_weights(pretrain_config(resolved["model"].get("kwargs", {}).get("pretrain_steps")))
    if not path.exists():
        raise UserError(f"no pretrained ToyWorld weights at {path}: run python -m benchmarks.toyworld.pretrain first")
    found = weights_sha256(path)
    if found != weights_of(resolved):
        raise UserError(f"the cached weights {path} have sha256 {found}, the config pins {weights_of(resolved)}")
    return found


def sweep(names: list[str], seeds: int, out: Path, work: Path, *, extra: tuple[str, ...] = (), run: bool = True):
    """Run what is not finished (nothing unless ``run``) and return what results.json holds."""
    jobs = plan(names, seeds, extra)
    sha = weights_of(jobs[0][1])
    stored = {(arm.name, seed): finished(out, arm.name, resolved, seed) for arm, resolved, seed in jobs}
    todo = [job for job in jobs if stored[(job[0].name, job[2])] is None]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} runs already finished in {out / 'runs'}; running {len(todo) * run}")
    for arm, resolved, seed in jobs if run else []:
        if (record := stored[(arm.name, seed)]) is not None:
            stored[(arm.name, seed)] = brought_up_to_date(record, arm, resolved, seed, out, work, extra)
    if run and todo:
        check_weights(jobs[0][1])
        for arm, resolved, seed in todo:
            record = run_one(arm, seed, resolved, work, extra)
            if record["evaluations"][0]["iteration"] != 0:  # a run with eval.at_start=false
                start = start_evaluation(resolved, (*arm.overrides, *extra), out, work)
                record["evaluations"] = [start, *record["evaluations"]]
            stored[(arm.name, seed)] = with_drift(record, work / slug(arm.name) / f"seed{seed}", out)
            first, last = record["evaluations"][0], record["evaluations"][-1]
            print(
                f"{arm.name:24s} seed {seed}: gold {first['gold']:.3f} -> {last['gold']:.3f}, proxy "
                f"{first['reward']:.3f} -> {last['reward']:.3f}, {record['train_s_per_iteration']:.1f} s/iteration",
                flush=True,
            )
    results = {
        "weights_sha256": sha,
        "base_config": str(BASE_CONFIG.relative_to(REPOSITORY)),
        "arms": {name: list(ARMS[name].overrides) + list(extra) for name in names},
        "seeds": seeds,
        "runs": [],
    }
    for job in jobs:
        if (record := stored[(job[0].name, job[2])]) is not None:
            results = join(results, record)
    return results


def main() -> None:
    from . import report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), help="arms to run (default: all)")
    parser.add_argument("--seeds", type=int, default=6, help="seeds per arm")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every arm")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results.json and runs/ go here")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="the runs' output folders")
    parser.add_argument(
        "--results-md", type=Path, default=report.RESULTS_MD, help="the file whose section is rewritten"
    )
    parser.add_argument("--collect", action="store_true", help="run nothing: report the finished runs")
    args = parser.parse_args()
    command = "python -m benchmarks.toyworld.sweep " + shlex.join(sys.argv[1:])
    try:
        results = sweep(args.arms, args.seeds, args.out, args.work, extra=tuple(args.set), run=not args.collect)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(UserError.exit_code)
    results["command"] = command
    write_atomically(args.out / "results.json", json.dumps(results, indent=1))
    report.write(results, args.results_md, os.path.relpath(args.out.resolve() / "results.json", REPOSITORY))


if __name__ == "__main__":
    main()
