class BuildError(Exception):
    """A user-facing failure: one sentence that says what is wrong and what to do."""
