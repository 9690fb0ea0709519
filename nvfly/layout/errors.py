"""Error type of the layout algebra."""
from __future__ import annotations

from nvfly.errors import NvflyError


class LayoutError(NvflyError, ValueError):
    """A layout operation cannot be carried out.

    Raised for malformed shapes/strides, for violated CuTe admissibility conditions
    (e.g. the stride/shape divisibility conditions of ``composition``), and when an
    operation needs the Python value of an integer that is only known at run time
    (a dynamic, traced integer).
    """
