"""Errors a user can cause. The CLI prints them as one line and exits non-zero, never a traceback."""


class UserError(Exception):
    """A problem the user can fix: bad flag, missing model, over-long prompt, corrupt file."""

    exit_code = 2


class ModelLoadError(UserError):
    """The model folder or registry entry cannot be loaded."""


class RequestError(UserError):
    """A single request cannot be served (too long for the context or the whole pool)."""
