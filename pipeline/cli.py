"""The ``sagegrpo`` command line: parsing, help pages, and dispatch to ``pipeline.commands``, which does the work.
User mistakes exit 2 with one line on stderr; other failures exit 1."""

from __future__ import annotations

import argparse
import os
import re
import sys
from datetime import date

from sage_grpo.core.errors import (
    RETRYABLE_EXIT_CODE,
    RetryableStop,
    StoreUnavailable,
    UserError,
    first_line,
    out_of_space,
)
from sage_grpo.core.ops_cache import use_this_environments_resolved_path
from sage_grpo.core.secrets import mask_process_output, mask_uri
from sage_grpo.pipeline import commands


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints usage; we promise one line
        raise UserError(message)


def _add_inspect_sde(subparsers) -> None:
    parser = subparsers.add_parser("inspect-sde", help="print noise std, N_t and S_t per step of a schedule")
    parser.add_argument("--variant", default="all", help="dance, flow, cps, sage or all")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--shift", type=float, default=5.0)
    parser.add_argument("--eta", type=float, default=0.5)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="FILE.png", help="draw std and N_t per step")
    parser.set_defaults(handler=_inspect_sde)


def _inspect_sde(args) -> int:
    return commands.inspect_sde_command(args.variant, args.steps, args.shift, args.eta, args.json, args.plot)


def _add_run(subparsers) -> None:
    parser = subparsers.add_parser("run", help="train: the whole pipeline on a config")
    parser.add_argument("config", help="run config YAML")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    parser.add_argument("--resume", metavar="auto|URI", help="continue from a checkpoint: auto = the newest verified")
    parser.add_argument("--max-iterations", type=int, help="shorthand for run.max_iterations=N")
    parser.add_argument(
        "--fresh-start",
        action="store_true",
        help="start a new run even if the checkpoint root holds another run's (or only broken) "
        "checkpoints; they are kept, never pruned",
    )
    parser.set_defaults(handler=_run)


def _run(args) -> int:
    overrides = list(args.overrides)
    if args.max_iterations is not None:
        overrides.append(f"run.max_iterations={args.max_iterations}")
    return commands.run_command(
        args.config, overrides, resume=args.resume, fresh_start=args.fresh_start, verbosity=args.verbosity
    )


def _add_eval(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="evaluate a saved policy on the held-out prompts")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    parser.add_argument("--checkpoint", required=True, metavar="URI|auto", help="a checkpoint step URI, or auto")
    parser.set_defaults(handler=_eval)


def _eval(args) -> int:
    return commands.eval_command(args.config, list(args.overrides), args.checkpoint, verbosity=args.verbosity)


def _add_sample(subparsers) -> None:
    parser = subparsers.add_parser("sample", help="write videos for a prompt from the current (or a saved) policy")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    parser.add_argument("--prompt", required=True, action="append", help="repeat for several prompts")
    parser.add_argument("--checkpoint", metavar="URI|auto", help="a saved policy; default: the config's model")
    parser.add_argument("--out", default="samples", help="directory for the videos (default: samples)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(handler=_sample)


def _sample(args) -> int:
    return commands.sample_command(
        args.config, list(args.overrides), args.prompt, args.checkpoint, args.out, args.seed, verbosity=args.verbosity
    )


def _add_export(subparsers) -> None:
    parser = subparsers.add_parser("export", help="write a checkpoint's policy in the diffusers format (LoRA or full)")
    parser.add_argument("config", help="the run config the checkpoint was trained with")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="auto|N|URI",
        help="auto = the newest verified step, or a step number / step URI in checkpoint.uri",
    )
    parser.add_argument("--out", help="output folder (default: <run.output_dir>/exports/step-N)")
    parser.set_defaults(handler=_export)


def _export(args) -> int:
    return commands.export_command(
        args.config, list(args.overrides), args.checkpoint, args.out, verbosity=args.verbosity
    )


def _add_config(subparsers) -> None:
    parser = subparsers.add_parser(
        "config", help="print the resolved, validated config (defaults filled, secrets masked)"
    )
    parser.add_argument("config", help="run config YAML")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    parser.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    parser.set_defaults(handler=_config)


def _config(args) -> int:
    return commands.config_command(args.config, list(args.overrides), as_json=args.json)


def _add_env(subparsers) -> None:
    parser = subparsers.add_parser("env", help="versions and devices, for bug reports")
    parser.set_defaults(handler=_env)


def _env(args) -> int:
    return commands.env_command()


def _add_check_reward(subparsers) -> None:
    parser = subparsers.add_parser("check-reward", help="build a reward, score synthetic videos with real prompts")
    parser.add_argument(
        "target", metavar="SPEC|CONFIG", help="run or rewards YAML, or a reward name / package.module:Class"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="config overrides, or the spec's (kwargs.x=1)"
    )
    parser.add_argument(
        "--data", metavar="SOURCE", help="prompt file (.txt/.jsonl/.csv, path or s3://) instead of the config's"
    )
    parser.add_argument("--videos", type=int, default=4, help="synthetic videos to score (default 4)")
    parser.add_argument("--size", metavar="FxHxW", help="frames x height x width (default: model.kwargs, else 9x64x64)")
    parser.add_argument("--device", help="device for the reward (default: cuda if available, else cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-sensitivity",
        dest="sensitivity",
        action="store_false",
        help="skip scoring perturbed copies (frames, fps, resolution, brightness, saturation)",
    )
    parser.set_defaults(handler=_check_reward)


def _check_reward(args) -> int:
    return commands.check_reward_command(
        args.target,
        list(args.overrides),
        data=args.data,
        num_videos=args.videos,
        size=args.size,
        device=args.device,
        seed=args.seed,
        sensitivity=args.sensitivity,
    )


def _add_preflight(subparsers) -> None:
    parser = subparsers.add_parser(
        "preflight",
        help="two short iterations of the real run on this node: pass/fail checks to run before spending GPU-hours",
    )
    parser.add_argument("config", help="run config YAML")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    parser.set_defaults(handler=_preflight)


def _preflight(args) -> int:
    return commands.preflight_command(args.config, list(args.overrides), verbosity=args.verbosity)


def _add_serve_reward(subparsers) -> None:
    parser = subparsers.add_parser("serve-reward", help="serve configured rewards over HTTP for the remote reward")
    parser.add_argument("config", help="YAML file with a 'rewards:' list of reward specs")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 to serve other machines)")
    parser.add_argument("--device", help="device for the reward models (default: cuda if available, else cpu)")
    parser.add_argument("--max-body-mb", type=float, default=1024.0, help="largest request body (default 1024)")
    parser.add_argument("--workers", type=int, default=8, help="connections handled at once (default 8)")
    parser.add_argument("--read-timeout", type=float, default=60.0, help="seconds to receive one request")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds to score one request")
    parser.add_argument("--max-batch", type=int, default=32, help="videos per merged reward call")
    parser.add_argument("--token-env", metavar="VAR", help="require the bearer token held in this variable")
    parser.add_argument("--token-file", metavar="FILE", help="require the bearer token held in this file")
    parser.set_defaults(handler=_serve_reward)


def _serve_reward(args) -> int:
    settings = {
        "max_body_mb": args.max_body_mb,
        "workers": args.workers,
        "read_timeout_s": args.read_timeout,
        "request_timeout_s": args.request_timeout,
        "max_batch": args.max_batch,
        "token_env": args.token_env,
        "token_file": args.token_file,
    }
    return commands.serve_reward_command(args.config, args.host, args.port, args.device, settings)


def _add_plan(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="per-GPU memory for a config: fits (exit 0) or not (1), what fits")
    parser.add_argument("config", help="run config YAML")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="GB of memory per GPU (default 80)")
    parser.add_argument(
        "--sequence-parallel", type=int, metavar="K", help="Ulysses group size (default: the config's parallel K)"
    )
    parser.add_argument("--mfu", type=float, default=0.35, help="MFU the GPU-hours assume (default 0.35)")
    parser.add_argument("--gpu", default="H100", help="GPU whose bf16 peak the GPU-hours assume (default H100)")
    parser.set_defaults(handler=_plan)


def _plan(args) -> int:
    return commands.plan_command(
        args.config,
        list(args.overrides),
        args.gpus_per_node,
        args.nodes,
        args.gpu_mem,
        args.sequence_parallel,
        mfu=args.mfu,
        gpu_name=args.gpu,
    )


def _add_promote(subparsers) -> None:
    parser = subparsers.add_parser("promote", help="move the champion alias to a model version that passes the gate")
    parser.add_argument(
        "--config",
        help="run config YAML: its registry section (model name, primary metric, margin, "
        "guards) and tracking URI are the gate's defaults; the flags below win",
    )
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides of --config, as for run")
    parser.add_argument("--model", help="registered model name (default: the config's registry.model_name)")
    parser.add_argument("--version", help="model version to judge (default: the challenger)")
    parser.add_argument("--primary-metric", help="default: registry.primary_metric, eval/reward")
    parser.add_argument(
        "--margin", type=float, help="the primary metric must improve by more (default: registry.margin, 0.002)"
    )
    parser.add_argument(
        "--guard",
        action="append",
        metavar="METRIC=TOL",
        help="largest allowed drop of a metric; repeatable (default: registry.guards)",
    )
    parser.add_argument(
        "--min-eval-prompts",
        type=int,
        help="refuse a version scored on fewer prompts (default: registry.min_eval_prompts, 8)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the decision, change nothing")
    parser.add_argument(
        "--tracking-uri",
        help="MLflow server (default: tracking.tracking_uri, then MLFLOW_TRACKING_URI, then the config's run store)",
    )
    parser.set_defaults(handler=_promote)


def _promote(args) -> int:
    return commands.promote_command(
        args.config,
        list(args.overrides),
        model=args.model,
        version=args.version,
        primary_metric=args.primary_metric,
        margin=args.margin,
        guards=parse_guards(args.guard) if args.guard else None,
        min_eval_prompts=args.min_eval_prompts,
        dry_run=args.dry_run,
        tracking_uri=args.tracking_uri,
    )


def parse_guards(specs: list[str]) -> dict[str, float]:
    """``["eval/aesthetic=0.05", ...]`` as ``{"eval/aesthetic": 0.05}``."""
    return dict(_parse_guard(spec) for spec in specs)


def _parse_guard(spec: str) -> tuple[str, float]:
    metric, _, tolerance = spec.rpartition("=")
    try:
        value = float(tolerance)
    except ValueError:
        value = -1.0
    if not metric or value < 0:
        raise UserError(f"--guard {spec!r}: expected METRIC=TOLERANCE with a tolerance >= 0")
    return metric, value


def _add_schedule(subparsers) -> None:
    parser = subparsers.add_parser(
        "schedule", help="the scheduled run: newest prompts, train (registers the challenger), promote"
    )
    parser.add_argument("config", nargs="?", help="run config YAML (or --config CONFIG)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key.sub=value",
        help="config overrides for training (the schedule's own keys come after and win)",
    )
    parser.add_argument("--config", dest="config_option", metavar="CONFIG", help=argparse.SUPPRESS)
    parser.add_argument(
        "--prompts",
        required=True,
        help="folder or s3:// prefix of prompt files, one per set, the newest sorting last (e.g. 2026-12-02.jsonl)",
    )
    parser.add_argument("--checkpoint-root", required=True, help="folder or s3:// prefix of the scheduled runs")
    parser.add_argument("--model", required=True, help="registered model name for promotion")
    parser.add_argument("--work-dir", default="/cache/runs", help="local folder for outputs and caches")
    parser.add_argument(
        "--nproc-per-node", type=int, help="training processes on this node (default: its GPU count, 1 without one)"
    )
    parser.add_argument("--date", type=date.fromisoformat, default=None, help="today, for tests (YYYY-MM-DD)")
    parser.add_argument("--dry-run", action="store_true", help="print the decision and commands, run nothing")
    parser.set_defaults(handler=_schedule)


def _schedule(args) -> int:
    if args.config_option and args.config and "=" in args.config:  # `--config C key=value`: no positional config
        args.config, args.overrides = None, [args.config, *args.overrides]
    if bool(args.config) == bool(args.config_option):
        raise UserError("schedule: give the run config once, as `sagegrpo schedule CONFIG ...` (or --config CONFIG)")
    return commands.schedule_command(
        args.config or args.config_option,
        list(args.overrides),
        args.prompts,
        args.checkpoint_root,
        args.model,
        args.work_dir,
        args.nproc_per_node,
        args.date,
        args.dry_run,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sagegrpo", description="SAGE-GRPO fine-tuning for text-to-video diffusion models")
    # The deepspeed launcher appends --local_rank; the local rank is read from LOCAL_RANK, which it also sets.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--version", action="version", version=f"%(prog)s {commands.package_version()}")
    noise = parser.add_mutually_exclusive_group()
    noise.add_argument(
        "-v",
        "--verbose",
        dest="verbosity",
        action="store_const",
        const=1,
        default=0,
        help="show the libraries' own logs and warnings too",
    )
    noise.add_argument(
        "-q", "--quiet", dest="verbosity", action="store_const", const=-1, help="warnings and errors only"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_run(subparsers)
    _add_eval(subparsers)
    _add_sample(subparsers)
    _add_inspect_sde(subparsers)
    _add_export(subparsers)
    _add_config(subparsers)
    _add_env(subparsers)
    for add in (_add_preflight, _add_check_reward, _add_serve_reward, _add_plan, _add_promote, _add_schedule):
        add(subparsers)
    _document(subparsers)
    return parser


EXAMPLES = {
    "run": "sagegrpo run configs/demo.yaml run.max_iterations=4 lora.enabled=true",
    "eval": "sagegrpo eval configs/demo.yaml --checkpoint auto | jq .",
    "sample": 'sagegrpo sample configs/demo.yaml --checkpoint auto --prompt "a red kite" --out samples',
    "inspect-sde": "sagegrpo inspect-sde --variant all --steps 20 --shift 5 --eta 0.5 --json",
    "export": "sagegrpo export configs/demo.yaml --checkpoint auto --out exports/demo",
    "config": "sagegrpo config configs/demo.yaml update.learning_rate=1e-4",
    "env": "sagegrpo env",
    "preflight": "sagegrpo preflight configs/hunyuanvideo15_sage_lora.yaml",
    "check-reward": "sagegrpo check-reward my_rewards.module:MyReward --videos 4",
    "serve-reward": "sagegrpo serve-reward rewards.yaml --port 8000",
    "plan": "sagegrpo plan configs/hunyuanvideo15_sage_full.yaml --gpus-per-node 8 --nodes 8",
    "promote": "sagegrpo promote --model t2v-policy --config configs/demo.yaml --dry-run",
    "schedule": "sagegrpo schedule configs/demo.yaml --prompts s3://b/prompts/ --checkpoint-root s3://b/ckpt --model m",
}
EXIT_CODES = """exit codes:
  0   done
  1   a failure that would recur (preflight: a check failed)
  2   a mistake in the command or the config: one line on stderr, nothing written
  75  retryable, restart with --resume auto: stopped by SIGTERM/SIGUSR1 or its time budget after a committed
      checkpoint, a store or tracking server unreachable, a full disk (nothing committed is lost)"""


def _document(subparsers) -> None:
    """Every subcommand's own help page: what it does (its line in the command list), an example and the exit codes."""
    summaries = {action.dest: action.help for action in subparsers._choices_actions}  # argparse keeps them only here
    for name, parser in subparsers.choices.items():
        parser.description = summaries[name]
        parser.epilog = f"example:\n  {EXAMPLES[name]}\n\n{EXIT_CODES}"
        parser.formatter_class = argparse.RawDescriptionHelpFormatter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options and ``key=value`` overrides in any order (argparse alone stops collecting positionals at the first
    option, so ``run CONFIG --max-iterations 4 key=value`` would be refused)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    if extra != overrides or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = list(args.overrides) + overrides
    return args


# What a terminal or a log collector takes for a line break (str.splitlines' set): a YAML key or value may hold one.
_LINE_BREAK = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def _one_line(error: Exception) -> str:
    """The message of ``error`` as one line, its line breaks escaped and credentials masked."""
    return _LINE_BREAK.sub(lambda match: repr(match.group())[1:-1], mask_uri(str(error)))


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        code = args.handler(args)
        sys.stdout.flush()  # here, so that a reader gone away is seen by the handler below
    except UserError as error:
        print(f"sagegrpo: error: {_one_line(error)}", file=sys.stderr)
        return UserError.exit_code
    except StoreUnavailable as error:
        print(
            f"sagegrpo: checkpoint store unavailable (retryable, restart with --resume auto): {mask_uri(str(error))}",
            file=sys.stderr,
        )
        return StoreUnavailable.exit_code
    except BrokenPipeError:
        # `sagegrpo ... | head`: the reader had what it wanted. As Python's docs advise, stdout goes to devnull so the
        # interpreter's own flush at exit does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except RetryableStop as error:
        print(f"sagegrpo: {mask_uri(str(error))} (retryable, {error.advice})", file=sys.stderr)
        return RetryableStop.exit_code
    except Exception as error:
        if not out_of_space(error):
            raise
        # Checkpoints commit whole or not at all and exports are moved into place whole: space freed, a resume
        # continues from the last commit.
        print(
            f"sagegrpo: no space left on device: {mask_uri(first_line(error))} (retryable, restart with --resume auto)",
            file=sys.stderr,
        )
        return RETRYABLE_EXIT_CODE
    except KeyboardInterrupt:
        print("sagegrpo: interrupted", file=sys.stderr)
        return 130
    return code


def program() -> int:
    """``sagegrpo`` as a program (the console script, ``python -m sage_grpo.pipeline.cli``): ``main``, then a
    process that started a process group ends through ``core.distributed.exit_launched``. Before torch is imported,
    the environment is reached by its resolved path (``core.ops_cache``: DeepSpeed's ops are built once for it)."""
    use_this_environments_resolved_path()
    mask_process_output()
    code = main()
    if "torch.distributed" not in sys.modules:  # --help, config, plan: no process group, and no torch to import
        return code
    from sage_grpo.core import distributed

    return distributed.exit_launched(code)


if __name__ == "__main__":
    sys.exit(program())
