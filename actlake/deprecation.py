"""Old public names kept for one release (CHANGELOG.md lists them): each use warns with
:class:`ActlakeDeprecationWarning`, which the command line shows (Python hides a plain DeprecationWarning raised
outside ``__main__``)."""

import warnings


class ActlakeDeprecationWarning(DeprecationWarning):
    """An old name of actlake's, still working until the release after the one that renamed it."""


def deprecated(message: str, stacklevel: int = 3) -> None:
    """Warn that an old name was used (``stacklevel`` 3: the caller of the function that calls this)."""
    warnings.warn(message, ActlakeDeprecationWarning, stacklevel=stacklevel)
