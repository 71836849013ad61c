"""The one exception type a user sees: a one-line message naming the problem and the fix."""


class BertforgeError(Exception):
    """Bad input or configuration. The CLI prints `error: <message>` and exits 2, without a traceback."""
