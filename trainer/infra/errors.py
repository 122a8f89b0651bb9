"""Errors a user can read: the input or the environment is wrong, not the program.

``InputError`` (flags, paths, save folders, start weights, checkpoints), ``dataset.errors.DataError`` (data files and
rows), ``ServerError`` (a server that replies wrongly, dies or hangs) and ``SaveFolderBusyError`` (another run holds
the save folder) say what is wrong and how to go on; an ``OSError`` (a full disk, a folder that cannot be written, a
file that is not there) names its path. ``run_script`` runs a script's ``main`` and ends such an error with one last
line on stderr, in argparse's form (``train_grpo.py: error: ...``), and exit status 1, without a traceback. Anything
else is a bug and keeps its traceback; ``--debug_mode 1`` keeps the traceback of both.
"""

import errno
import os
import sys

from dataset.errors import DataError


class UserError(Exception):
    """Base of the errors the user's input or environment causes; the message names the thing and the way on."""


class InputError(UserError, ValueError):
    """A flag, a data row, a path, a save folder, start weights or a checkpoint that cannot be used as given."""


class ServerError(UserError, RuntimeError):
    """A server (SGLang) that answered outside its protocol, failed, or did not answer in time."""


class SaveFolderBusyError(UserError, RuntimeError):
    """Another live run holds the save folder's checkpoint files."""


class RankZeroError(UserError, RuntimeError):
    """Raised on the other ranks when rank 0 stopped on a user's error; the message quotes rank 0's."""


class MissingPackageError(UserError, ModuleNotFoundError):
    """A package the given input needs (a reward model's tokenizer, say) is not installed; the message names it."""


# what a user can do about an OSError, by errno
OS_ERROR_HINTS = {
    errno.ENOSPC: "free space on that disk or pass a --save_dir / --run_dir on another one",
    errno.EDQUOT: "free space within your quota or pass a --save_dir / --run_dir elsewhere",
    errno.EACCES: "make that path writable for this user or pass another folder",
    errno.EPERM: "make that path writable for this user or pass another folder",
    errno.EROFS: "the file system is read-only: pass a folder on a writable one",
}


def user_message(error):
    """The one line that ends a run for ``error``, or None when ``error`` is a bug (no ``UserError``, no
    ``DataError``, no ``OSError``). Whitespace (newlines included) collapses to single spaces, so the message is
    the last line."""
    if isinstance(error, (UserError, DataError)):  # DataError: dataset/'s own (it imports nothing of trainer/)
        message = str(error)
    elif isinstance(error, OSError):
        message = str(error)
        if error.errno is not None and error.strerror:  # "[Errno 28] ..." -> the text and the path
            message = error.strerror + (f": {error.filename}" if error.filename else "")
        hint = OS_ERROR_HINTS.get(error.errno)
        if hint and error.filename:  # the system's own message on a path; this project's messages name the fix
            message += f" ({hint})"
    else:
        return None
    return " ".join(message.split())


def debug_requested(argv):
    """True when ``argv`` turns ``--debug_mode`` on (``--debug_mode``, ``--debug_mode 1``, ``--debug_mode=1``)."""
    for index, arg in enumerate(argv):
        if arg == "--debug_mode":
            value = argv[index + 1] if index + 1 < len(argv) else "1"
            return value.startswith("-") or value not in ("0", "false", "False", "no")
        if arg.startswith("--debug_mode="):
            return arg.split("=", 1)[1] not in ("0", "false", "False", "no")
    return False


def run_script(main, argv=None):
    """Run ``main()`` as a script's entry point: a user error (``user_message`` not None) ends the process with
    ``{script}: error: {message}`` as the last line on stderr and exit status 1, unless ``--debug_mode`` is on in
    ``argv`` (default ``sys.argv[1:]``), which re-raises it with its traceback. Bugs propagate unchanged."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return main()
    except Exception as error:  # sorted into the user's and the program's just below
        message = user_message(error)
        if message is None or debug_requested(argv):
            raise
        sys.stdout.flush()
        print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
