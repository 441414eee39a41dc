"""User-facing errors.

Every problem a user can cause (bad input file, mismatched artifacts, wrong flag) is raised as a
`DraftsmithError` whose message is one line naming the file, line and field. The CLI prints it without
a traceback; library callers can catch it.
"""


class DraftsmithError(Exception):
    """A clear, one-line error about user input or artifacts (printed without a traceback)."""


class BadRecordError(DraftsmithError):
    """One input record is unusable. `where` is 'FILE:LINE' (or just FILE for a source file)."""

    def __init__(self, where: str, reason: str):
        self.where = where
        self.reason = reason
        super().__init__(f"{where}: {reason}")


class ArtifactMismatchError(DraftsmithError):
    """An artifact (store, drafter) was produced for another target/tokenizer/config."""
