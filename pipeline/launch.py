"""torchrun for schedulers that restart on an exit code:
``python -m sage_grpo.pipeline.launch [--retry-exit-code N] TORCHRUN-ARGS``.

torchrun itself exits 1 whenever a worker fails, whatever the worker's status, so the status 75 with which a run
reports "checkpointed on SIGTERM/SIGUSR1, restart me" (pipeline/errors.py) would reach Kubernetes or Slurm as an
ordinary failure. This runs the same launcher in-process (``torch.distributed.run``, same arguments) and turns its
outcome into a status a scheduler can act on:

- every worker finished: 0;
- the root-cause failure (the first worker to fail, as torchrun reports it) exited 75, or this launcher itself got a
  stop signal that torchrun relayed to its workers: ``--retry-exit-code`` (default 75). Resuming from the newest
  committed checkpoint is right in both cases, whether or not the interrupted step's checkpoint was committed;
- anything else: the root cause's own status when it is a plain exit (2 stays "user error"), else 1. A worker killed
  by a signal (OOM killer, segfault) maps to 1 on purpose: it would recur, and Kubeflow's ExitCode policy would
  restart anything >= 128 forever (kubeflow/training-operator#2045: it ignores backoffLimit).

Pass ``--signals-to-handle=SIGTERM,SIGINT,SIGUSR1`` so torchrun relays Slurm's pre-timeout SIGUSR1 too, and a
``--shutdown-timeout`` long enough for a checkpoint: torchrun SIGKILLs its workers when it runs out (default 30 s).
"""

from __future__ import annotations

import argparse
import copy
import sys

from sage_grpo.core.errors import RETRYABLE_EXIT_CODE, UserError, first_line

PROG = "python -m sage_grpo.pipeline.launch"


def exit_status(root_cause_exitcode: int | None, signalled: bool, retry_exit_code: int) -> int:
    """The launcher's status from the root-cause worker status (None: all succeeded) and whether it was signalled."""
    if signalled or root_cause_exitcode == RETRYABLE_EXIT_CODE:
        return retry_exit_code
    if root_cause_exitcode is None:
        return 0
    return root_cause_exitcode if 0 < root_cause_exitcode < 128 else 1


def torchrun_arguments(argv: list[str]):
    """torchrun's arguments (its ``PET_*`` environment variables included) parsed and checked as its launch would
    check them, before any worker starts; a bad one (``--nnodes abc``, ``PET_NPROC_PER_NODE=many``) is a one-line
    UserError instead of torchrun's usage text or a traceback."""
    from torch.distributed.run import config_from_args, get_args_parser

    def refuse(message: str):
        raise UserError(message)

    parser = get_args_parser()
    parser.error = refuse  # argparse's default prints the whole usage, then exits
    args = parser.parse_args(argv)
    try:
        config_from_args(copy.deepcopy(args))  # what run() builds its launch from: it only reads the arguments
    except (ValueError, AssertionError) as error:
        raise UserError(f"torchrun's arguments (or their PET_* variables): {first_line(error)}") from None
    return args


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    ours = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    ours.add_argument(
        "--retry-exit-code",
        type=int,
        default=RETRYABLE_EXIT_CODE,
        help="status for a run to restart (Kubeflow's ExitCode policy restarts only >= 128)",
    )
    args, torchrun_argv = ours.parse_known_args(argv)
    try:
        launch = torchrun_arguments(torchrun_argv)
    except UserError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return UserError.exit_code
    try:
        run(launch)
    except ChildFailedError as error:
        _, failure = error.get_first_failure()
        return exit_status(failure.exitcode, False, args.retry_exit_code)
    except SignalException as error:
        print(
            f"{PROG}: stopped by {error.sigval.name}; workers were asked to checkpoint",
            file=sys.stderr,
        )
        return exit_status(None, True, args.retry_exit_code)
    return exit_status(None, False, args.retry_exit_code)


if __name__ == "__main__":
    sys.exit(main())
