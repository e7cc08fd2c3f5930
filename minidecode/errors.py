"""The one exception type for user mistakes: the CLI prints it as a one-line error, no traceback."""


class UserError(Exception):
    """A bad input the user can fix (path, config, prompt, sampling value, memory plan).

    field: the `Request` field the message is about (None when it is about no one field), so a
    caller can point at its own parameter (the server fills OpenAI's error `param` from it)."""

    def __init__(self, message: str = "", field: str | None = None):
        super().__init__(message)
        self.field = field
