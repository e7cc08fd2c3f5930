"""The one exception type for user mistakes: the CLI prints it as a one-line error, no traceback."""


class UserError(Exception):
    """A bad input the user can fix (path, config, prompt, sampling value, memory plan)."""
