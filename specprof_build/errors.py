import shlex


class BuildError(Exception):
    """A user-facing failure: one sentence that says what is wrong and what to do."""


def quote(arg) -> str:
    """A path or word as a shell takes it back: a hint's command can be pasted as it is."""
    return shlex.quote(str(arg))
