"""The error every check raises for input a user can fix: its message names the key, the file
or the value, and what is accepted. Commands print it as one line and exit 2."""


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and what is accepted."""
