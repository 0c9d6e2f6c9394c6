"""The one exception type that the command line turns into a clean error line."""


class UserError(Exception):
    """Bad input from the user: a wrong path, option or file. The CLI prints
    ``error: <message>`` and exits non-zero, without a traceback."""
