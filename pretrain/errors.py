"""The error every check raises for input a user can fix: its message names the key, the file
or the value, and what is accepted. Commands print it as one line and exit 2."""


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and what is accepted."""


class UnreadableCheckpoint(ConfigError):
    """A complete checkpoint whose files cannot be read (cut off, corrupt, missing): a resume
    passes over it to the previous complete one; anywhere else it is a one-line error."""

    def __init__(self, tag: str, problem: str) -> None:
        super().__init__(f"checkpoint {tag} cannot be read: {problem}")
        self.tag, self.problem = tag, problem
