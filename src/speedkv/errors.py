"""The one exception type for user mistakes (bad spec, bad path, bad option value).

Faces catch it: the CLI prints its message as one sentence and exits with code 2, the server
answers HTTP 400. Anything else escaping is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """A mistake in what the user asked for; the message says what is wrong and what is allowed."""
