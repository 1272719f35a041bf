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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sagegrpo", description="SAGE-GRPO fine-tuning for text-to-video diffusion models")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_inspect_sde(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.handler(args)
    except UserError as error:
        print(f"sagegrpo: error: {error}", file=sys.stderr)
        return UserError.exit_code


if __name__ == "__main__":
    sys.exit(main())
