"""The ``sagegrpo`` command line. User mistakes exit 2 with one line on stderr; other failures exit 1."""

from __future__ import annotations

import argparse
import sys

from pipeline import sde
from pipeline.errors import UserError


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
    from pipeline.inspect_sde import run

    if args.variant != "all" and args.variant not in sde.VARIANTS:
        raise UserError(f"--variant {args.variant!r} is not one of {', '.join(sde.VARIANTS)}, all")
    if args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    if args.eta < 0:
        raise UserError(f"--eta must be >= 0, got {args.eta}")
    if args.shift <= 0:
        raise UserError(f"--shift must be > 0, got {args.shift}")
    print(run(args.variant, args.steps, args.shift, args.eta, args.json, args.plot))
    return 0


def _add_run(subparsers) -> None:
    parser = subparsers.add_parser("run", help="train: the whole pipeline on a config")
    parser.add_argument("config", help="run config YAML")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    parser.add_argument("--resume", metavar="auto|URI", help="continue from a checkpoint: auto = the newest verified")
    parser.add_argument("--max-iterations", type=int, help="shorthand for run.max_iterations=N")
    parser.set_defaults(handler=_run)


def _run(args) -> int:
    from pipeline.commands import run_command

    overrides = list(args.overrides)
    if args.max_iterations is not None:
        overrides.append(f"run.max_iterations={args.max_iterations}")
    return run_command(args.config, overrides, resume=args.resume)


def _add_eval(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="evaluate a saved policy on the held-out prompts")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    parser.add_argument("--checkpoint", required=True, metavar="URI|auto", help="a checkpoint step URI, or auto")
    parser.set_defaults(handler=_eval)


def _eval(args) -> int:
    from pipeline.commands import eval_command

    return eval_command(args.config, list(args.overrides), args.checkpoint)


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
    from pipeline.commands import sample_command

    return sample_command(args.config, list(args.overrides), args.prompt, args.checkpoint, args.out, args.seed)


def _add_components(subparsers) -> None:
    """Subcommands that live beside their components."""
    from pipeline import memory_plan, registry, schedule
    from pipeline.rewards import server

    for module in (server, memory_plan, registry, schedule):
        module.register_cli(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sagegrpo", description="SAGE-GRPO fine-tuning for text-to-video diffusion models")
    # The deepspeed launcher appends --local_rank; the local rank is read from LOCAL_RANK, which it also sets.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_run(subparsers)
    _add_eval(subparsers)
    _add_sample(subparsers)
    _add_inspect_sde(subparsers)
    _add_components(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.handler(args)
    except UserError as error:
        print(f"sagegrpo: error: {error}", file=sys.stderr)
        return UserError.exit_code
    except KeyboardInterrupt:
        print("sagegrpo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
