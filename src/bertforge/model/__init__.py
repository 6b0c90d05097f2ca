"""bertforge models."""

# The family modules install the table of families that ModelConfig reads (see family.py) when the registry
# imports them; importing it here makes the table complete whichever model module is imported first.
from bertforge.model import architectures  # noqa: F401
