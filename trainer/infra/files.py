"""Files on disk: the project's one atomic write, the check that a folder takes files, and where weights live
(MiniMind's ``{save_dir}/{name}_{hidden}.pth`` naming, the repository's ``out/`` and ``model/``).

Infrastructure, not RL: a learner can skip this file.
"""

import errno
import glob
import os
import re
import shutil
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
DEFAULT_TOKENIZER_PATH = os.path.join(ROOT, "model")
DEFAULT_SAVE_DIR = os.path.join(ROOT, "out")


def atomic_write(writes):
    """Write files or folders so that each appears complete at its path or not at all, together.

    Every ``write(tmp)`` first creates its content at a temporary sibling of its path (a file, or a folder it
    makes itself), every file is fsynced, and only when all are written are they moved into place, in the
    dict's order (a folder is swapped in by two renames). A crash, a SIGKILL or a full disk while writing leaves
    every path as it was: a checkpoint's weights and its resume file are replaced together or not at all.
    Temporary files left by a killed writer (``{path}.tmp{PID}-*``, that PID gone) are removed by the next write to
    that path; a live process's are left alone.

    Args:
        writes: {path: write}, ``write`` a function of one argument, the temporary path to write to.
    Returns:
        the list of paths written.
    Raises:
        OSError: naming the path and the cause when a folder is not writable or a write fails; a full disk is
            named as such, with the space left (torch's zip writer reports a full disk as a RuntimeError, which
            is raised as this OSError too). Nothing was replaced then.
    """
    temporaries, path = {}, next(iter(writes), "")
    try:
        for path, write in writes.items():
            for stale in glob.glob(glob.escape(path) + ".tmp*"):  # left by a process killed mid-write
                if not writer_alive(stale):
                    remove(stale)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            temporaries[path] = f"{path}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}"
            write(temporaries[path])
            fsync_tree(temporaries[path])
        for path, tmp in temporaries.items():
            move_into_place(tmp, path)
    except (OSError, RuntimeError) as err:
        for tmp in temporaries.values():
            remove(tmp)
        code = getattr(err, "errno", None) or errno.EIO
        reason = describe_failure(err, os.path.dirname(os.path.abspath(path)))
        raise OSError(code, f"could not write {path}: {reason}") from err
    except BaseException:
        for tmp in temporaries.values():
            remove(tmp)
        raise
    return list(writes)


def writer_alive(temporary):
    """Whether the process that names ``temporary`` (``{path}.tmp{PID}-{hex}``) is another process still running."""
    match = re.search(r"\.tmp(\d+)-[0-9a-f]+$", temporary)
    if match is None or int(match[1]) == os.getpid():
        return False
    try:
        os.kill(int(match[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def move_into_place(tmp, path):
    """``os.replace`` for a file; for a folder, the old one is renamed aside, the new one in, the old removed."""
    if os.path.isdir(tmp) and os.path.exists(path):
        old = f"{path}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)


def fsync_tree(path):
    """fsync the file at ``path``, or every file of the folder at ``path``."""
    files = (
        [path]
        if os.path.isfile(path)
        else [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    )
    for file_path in files:
        with open(file_path, "rb") as f:
            os.fsync(f.fileno())


def remove(path):
    """Remove a file or a folder if it exists."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def describe_failure(err, folder, full_below_bytes=64 * 2**20):
    """The reason of a failed write in words: "the disk is full (12.0 MiB free in FOLDER; ...)" when the error is
    ENOSPC or the folder's file system has less than ``full_below_bytes`` left (a full disk surfaces as ENOSPC or,
    from torch's zip writer, as EIO "unexpected pos"), else the error's own text."""
    reason = getattr(err, "strerror", None) or str(err)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return reason
    if getattr(err, "errno", None) == errno.ENOSPC or free < full_below_bytes:
        return f"the disk is full ({free / 2**20:.1f} MiB free in {folder}; {reason})"
    return reason


def check_writable_dir(path):
    """Create ``path`` if needed and prove a file can be written there.

    Raises:
        OSError: naming ``path`` (not a folder, no permission, read-only or full disk).
    """
    probe = os.path.join(path, f".write_probe{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.remove(probe)
    except OSError as err:
        raise OSError(err.errno, f"{path} is not a writable folder: {err.strerror}") from err


def check_creatable_dir(path):
    """Prove ``path`` is a writable folder or can be made one, creating nothing: its nearest existing ancestor
    must be a writable folder (a run refused later at start-up leaves no folder behind).

    Raises:
        OSError: naming ``path`` and the ancestor that is not a folder or not writable.
    """
    existing = os.path.abspath(path)
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise OSError(errno.ENOTDIR, f"{path} cannot be a folder: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OSError(errno.EACCES, f"{path} is not writable: {existing} is not writable")


def weight_path(from_weight, save_dir, hidden_size, use_moe, allow_file=True):
    """MiniMind's naming: ``{save_dir}/{name}_{hidden}[_moe].pth``.

    For loading (``allow_file``): ``from_weight`` itself if it is a file; else the name in ``save_dir``; else,
    when that file does not exist, the name in the repository's ``out/`` (the bundled starting policy), so
    that ``--save_dir runs/exp1`` still starts from ``out/full_sft_256.pth``. When neither exists the path in
    ``save_dir`` is returned (and ``load_weights`` names it). Saves pass ``allow_file=False``: they always
    write into ``save_dir``.
    """
    if allow_file and os.path.isfile(from_weight):
        return from_weight
    suffix = "_moe" if use_moe else ""
    file_name = f"{from_weight}_{hidden_size}{suffix}.pth"
    path = os.path.join(save_dir, file_name)
    bundled = os.path.join(DEFAULT_SAVE_DIR, file_name)
    if allow_file and not os.path.isfile(path) and os.path.isfile(bundled):
        return bundled
    return path
