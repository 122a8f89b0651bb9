"""A training script's ``main(argv)`` run in the test's own process, with what ``python trainer/X.py ARGV`` reports.

For the tests whose subject is what a run does or refuses (its files, its messages, its exit status), not the process
itself: the script's modules are imported once per test session instead of once per run (about 3.6 s each). Tests
about the process (signals, exit by SIGKILL, torchrun, a traceback or its absence on the real command line) keep
``subprocess``.
"""

import contextlib
import importlib
import io
import os
import signal
import sys
from types import SimpleNamespace

from trainer.infra.errors import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_main(script, argv):
    """Run ``trainer/{script}.py`` with ``argv`` (a list of str) as its entry point does (``run_script``), in this
    process. Returns a namespace with ``returncode`` (0; 1 for a user error, whose one line ends stderr; argparse's
    2), ``stdout`` and ``stderr`` (str, what the run printed). A bug (any other exception) propagates. It runs in the
    repository's folder, as the subprocess tests do; the working folder, the signal handlers and ``sys.argv`` are
    restored afterwards."""
    module = importlib.import_module(f"trainer.{script}")
    stdout, stderr = io.StringIO(), io.StringIO()
    saved_argv, handlers = sys.argv, (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    sys.argv = [os.path.join(ROOT, "trainer", f"{script}.py"), *argv]  # run_script's message names the script
    saved_cwd = os.getcwd()
    os.chdir(ROOT)  # relative paths as the subprocess tests ran them (cwd = the repository)
    returncode = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                run_script(lambda: module.main(argv), argv)
            except SystemExit as exit_:
                returncode = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    finally:
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])
    return SimpleNamespace(returncode=returncode, stdout=stdout.getvalue(), stderr=stderr.getvalue())
