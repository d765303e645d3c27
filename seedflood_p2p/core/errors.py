"""The one exception type that reaches a user.

A `UserError` carries a single readable line that says what is wrong and what
to do about it. The CLI prints it as ``error: <line>`` and exits with status 2;
anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, flags, files or environment."""
