"""One exception type for bad input: the CLI prints its one-line message and exits with code 2; the
exit codes of `opd`; SIGTERM/SIGINT as an exception in the main thread."""
from __future__ import annotations

import signal
import threading


class UserError(Exception):
    """Bad input from the user (config, files, models). The message names the culprit."""

    exit_code = 2


# Exit codes of `opd` (docs/guarantees.md): 0 done; 1 a bug (traceback); 2 bad input (UserError, one
# line naming the culprit); 75 the disk filled up while writing (EX_TEMPFAIL: free space and run the
# same command again); 128 + N stopped by signal N (130 SIGINT, 143 SIGTERM). In every case but a bug
# the published artifacts are untouched and the same command resumes.
EXIT_NO_SPACE = 75


class Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGINT, raised in the main thread: the stage in flight is abandoned (Store.ensure removes
    its temp dir) and the CLI exits 128 + signum. A BaseException, so no `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def install_signal_handlers():
    """SIGTERM/SIGINT raise Interrupted in the main thread (once; later ones are ignored so the
    abandoned stage's cleanup finishes). Returns a function restoring the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    sigs = (signal.SIGTERM, signal.SIGINT)
    old = {s: signal.getsignal(s) for s in sigs}

    def handler(signum, frame):
        for s in sigs:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    for s in sigs:
        signal.signal(s, handler)
    return lambda: [signal.signal(s, h) for s, h in old.items()]
