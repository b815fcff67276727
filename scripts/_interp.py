"""Shared setup of the interpreter simulations (see ``epcomm.testing.interp``)."""
from epcomm.testing import interp  # noqa: F401
