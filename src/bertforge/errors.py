"""The one exception type for mistakes a user can make: the CLI prints its message on one line and exits 2."""


class UserError(Exception):
    """Bad input, named precisely (file, row, column or config key); never shown with a traceback."""
