"""torch's launcher (torchrun) as ``emapg train --nproc N`` runs it, its ends said in one line each: a worker
killed (SIGKILL: the kernel's out-of-memory killer, among others) or failing, or the launcher told to stop (the
``emapg train`` that started it ended). torch says these with its error report and a traceback a user has to read
through to the worker's exit code; each line here says what happened and how to go on.

    python -m emapg.launcher TORCHRUN-ARGUMENTS   (what emapg train --nproc runs; not a command of its own)
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from emapg.run.folder import LAUNCHER_ENV, RESUME_ENV


def _signal_name(number: int) -> str:
    return signal.Signals(number).name if number in {s.value for s in signal.Signals} else f"signal {number}"


def _failure_line(rank: int, failure) -> str:
    """What happened to one worker, as torch's report gives it (a negative exit code: killed by that signal)."""
    if failure.exitcode < 0:
        name = _signal_name(-failure.exitcode)
        why = " (the kernel's out-of-memory killer sends it, among others)" if name == "SIGKILL" else ""
        return f"worker rank {rank} (PID {failure.pid}) was killed by {name}{why}"
    return f"worker rank {rank} (PID {failure.pid}) exited with code {failure.exitcode} (its own message is above)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    resume = os.environ.get(RESUME_ENV)
    go_on = f"Continue from the last checkpoint: {resume}" if resume else ""
    try:
        run(args)
    except ChildFailedError as e:
        lines = [_failure_line(rank, f) for rank, f in sorted(e.failures.items())]
        killed = any(f.exitcode < 0 for f in e.failures.values())
        workers = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else None
        rest = "" if workers == len(e.failures) else "; the other workers were stopped"
        print(f"emapg: {'; '.join(lines)}{rest}." + (f" {go_on}" if killed and go_on else ""), file=sys.stderr)
        codes = [f.exitcode for f in e.failures.values()]  # a worker killed is the cause of the others' ends
        return 128 - min(codes) if min(codes) < 0 else max(codes)
    except SignalException as e:
        launcher = int(os.environ.get(LAUNCHER_ENV, "0"))
        gone = launcher and os.getppid() != launcher
        cause = f" (the emapg train that started it, PID {launcher}, ended)" if gone else ""
        print(f"emapg: torchrun (PID {os.getpid()}) was told to stop by {_signal_name(e.sigval)}{cause}; its workers "
              f"were stopped. {go_on}".rstrip(), file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
