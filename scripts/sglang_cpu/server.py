"""Start and stop an SGLang server on a CPU from Python: ``scripts/launch_sglang.sh`` at a free port, and the
server's process group stopped. Used by scripts/bench/bench.py, scripts/check_sglang.py and tests/test_sglang_server.py.
"""

import os
import signal
import socket
import subprocess
import time

LAUNCH_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch_sglang.sh")


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_cpu_server(folder, work_dir, sglang_python="", port=None, extra_args=(), env=None, timeout_s=None):
    """``scripts/launch_sglang.sh folder port *extra_args``: a server on 127.0.0.1, up when this returns.

    Its log goes to ``work_dir``, its PID file to ``$SGLANG_PID_DIR`` when set (.ci/run stops every server listed
    there on exit), else to ``work_dir``. ``sglang_python``: the server venv's python (default: the script's,
    the venv of scripts/setup_sglang_env.sh); ``port``: default a free one; ``env``: the environment (default
    os.environ); ``timeout_s``: seconds the script waits for /health (default: the script's).
    Returns (url, process-group id of the server).
    Raises:
        RuntimeError: when the script cannot start the server (the script prints why, with the log's tail).
    """
    port = port or free_port()
    pid_file = os.path.join(os.environ.get("SGLANG_PID_DIR") or work_dir, f"sglang-{port}.pid")
    env = dict(
        os.environ if env is None else env,
        SGLANG_PID_FILE=pid_file,
        SGLANG_LOG=os.path.join(work_dir, f"sglang-{port}.log"),
    )
    if sglang_python:
        env["SGLANG_PYTHON"] = sglang_python
    if timeout_s:
        env["SGLANG_LAUNCH_TIMEOUT"] = str(timeout_s)
    command = ["bash", LAUNCH_SCRIPT, folder, str(port), *extra_args]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"scripts/launch_sglang.sh could not start a server (exit {done.returncode}; its "
            f"messages are above): {' '.join(command)}"
        )
    with open(pid_file, encoding="utf-8") as f:
        return done.stdout.strip().splitlines()[-1], int(f.read())


def stop_server(pgid, timeout_s=60):
    """SIGTERM to the server's process group (launcher, scheduler, detokenizer), SIGKILL after ``timeout_s``
    seconds; returns once the group is gone. A launcher that is this process's child is reaped."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            os.waitpid(pgid, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(pgid, signal.SIGKILL)
