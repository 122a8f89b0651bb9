"""When a run stops: stop requests (SIGTERM, Ctrl-C) honoured at a safe point, and updates skipped for a NaN or inf
(``nonfinite_parts``, ``BadStepGuard``), with a stop after too many in a row.

Infrastructure, not RL: a learner can skip this file.
"""

import signal

import torch

from trainer.infra.distributed import Logger, any_rank


class StopSignal:
    """Turns SIGTERM / SIGINT (Ctrl-C) into a request that the loop honours at its next safe point.

    The loop calls ``requested(device)`` once per step; it agrees across ranks (any rank signalled), so every
    rank saves and exits at the same step. A second Ctrl-C aborts at once, without saving. Under torchrun the
    launcher forwards the signal to every worker and sends SIGKILL 30 s later: a step plus a save that take
    longer lose this save (the previous periodic checkpoint stays intact).
    """

    def __init__(self):
        global ACTIVE
        self.signal_name = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)
        ACTIVE = self

    def _handle(self, signum, frame):
        # only set a flag: printing from a handler can hit a print in progress ("reentrant call")
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    @property
    def received(self):
        """True once this process got SIGTERM or SIGINT (no collective: for checks inside work that every rank does
        alone, such as the held-out evaluation between its batches)."""
        return self.signal_name is not None

    def requested(self, device):
        """True when any rank has received SIGTERM or SIGINT (a collective: every rank calls it each step)."""
        stop = any_rank(self.signal_name is not None, device)
        if stop:
            Logger(
                f"{self.signal_name or 'a signal to another rank'} received: saving a resume checkpoint "
                f"(under torchrun, within its 30 s before it sends SIGKILL)"
            )
        return stop

    def stopped_message(self, step, resume_command):
        """The line printed when the run stops at ``step``: which signal, and the command that resumes."""
        return (
            f"stopped by {self.signal_name or 'a signal to another rank'} at step {step}; resume with:\n"
            f"  {resume_command}"
        )

    def restore(self):
        """Give SIGTERM / SIGINT back their default behaviour."""
        global ACTIVE
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if ACTIVE is self:
            ACTIVE = None


ACTIVE = None  # the StopSignal installed by the running main, if any


def stop_received():
    """The name of the signal the running main's ``StopSignal`` received ("SIGTERM", "SIGINT"), else None: for waits
    that must not outlast a stop request (an HTTP request to a server that does not answer)."""
    return ACTIVE.signal_name if ACTIVE is not None else None


def nonfinite_parts(**tensors):
    """Names of the given tensors (or floats) that hold a NaN or inf, e.g. ['rewards', 'loss']."""
    bad = []
    for name, value in tensors.items():
        value = torch.as_tensor(value)
        if value.is_floating_point() and not torch.isfinite(value).all():
            bad.append(name)
    return bad


def nonfinite_on_any_rank(device, **tensors):
    """(names of the given tensors or floats that hold a NaN or inf on this rank, whether any rank found one): the
    check every rank agrees on, one all_reduce (``any_rank``)."""
    problems = nonfinite_parts(**tensors)
    return problems, any_rank(bool(problems), device)


class BadStepGuard:
    """Counts updates that were skipped because of a NaN or inf (in the rewards, the loss or the gradients).

    ``record(step, skipped, problems)`` logs a skipped update and raises ``SystemExit`` (exit code 1, a clear
    message) once ``max_bad_steps`` updates in a row were skipped; a good step resets the count.
    """

    def __init__(self, max_bad_steps, in_a_row=0):
        self.max_bad_steps = max_bad_steps
        self.in_a_row = in_a_row

    def record(self, step, skipped, problems=()):
        """skipped: whether the update of ``step`` was skipped; problems: what was non-finite on this rank (empty
        when only another rank saw a NaN or inf)."""
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        what = ", ".join(problems) or "values on another rank"
        Logger(
            f"step {step}: update skipped, non-finite {what} "
            f"({self.in_a_row} in a row, --max_bad_steps {self.max_bad_steps})"
        )
        if self.in_a_row >= self.max_bad_steps:
            raise SystemExit(
                f"stopping at step {step}: {self.in_a_row} updates in a row had non-finite "
                f"{what}; the weights were not changed by them, and the last saved "
                f"checkpoint holds no NaN. Lower --learning_rate or check the reward function."
            )


def finish_run(stop_signal, stopped_at, resume_command, evaluator, writer, run_lock):
    """The end of a training run: the stop line with ``resume_command`` when a stop request ended it at step
    ``stopped_at`` (None: it ran to its end), the held-out evaluation's before/after lines, then the metrics file
    closed, the signal handlers restored and the save folder's lock released (another run may use it)."""
    if stopped_at is not None:
        Logger(stop_signal.stopped_message(stopped_at, resume_command))
    for line in evaluator.summary_lines() if evaluator is not None else []:
        Logger(line)
    writer.close()
    stop_signal.restore()
    if run_lock is not None:
        run_lock.close()
