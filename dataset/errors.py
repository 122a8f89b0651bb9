"""The error bad data raises: a data file, a row or a data setting that cannot be used as given.

It depends on nothing, so that ``dataset/`` imports nothing from ``trainer/``; ``trainer/infra/errors.py`` counts it
among the user's errors (one line naming the file and line, no traceback).
"""


class DataError(ValueError):
    """A data file, a row or a data setting that cannot be used as given; the message names the file (and line) and
    the way on."""
