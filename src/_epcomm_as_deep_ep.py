"""The switch ``EPCOMM_AS_DEEP_EP=1``: epcomm answers every ``import deep_ep`` in the process.

How it works (docs/clients.md has the whole story):

- epcomm's wheel (normal and editable, see ``build_backend/epcomm_build.py``) puts one file into
  site-packages, ``epcomm_as_deep_ep.pth``, with a single line that Python's ``site`` runs at start-up
  in every process::

      import os; "EPCOMM_AS_DEEP_EP" in os.environ and __import__("_epcomm_as_deep_ep").install()

  Without the variable that is one dictionary look-up: nothing is imported, nothing named
  ``deep_ep`` is provided or shadowed.
- With it, ``install()`` reads the value (``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/
  ``off``/empty; anything else is one line on stderr and counts as off) and, when on, puts ``DeepEPFinder`` first on ``sys.meta_path``. The finder answers
  only the top-level name ``deep_ep``: it returns a spec for the directory ``epcomm/_deep_ep``, so
  ``deep_ep``, ``deep_ep.utils`` and ``deep_ep.buffer`` load from there (submodules through the
  ordinary path finder) and ``importlib.util.find_spec("deep_ep")`` finds them. Being first, it wins
  over a real DeepEP installed beside it; ``epcomm env`` says when one is shadowed.

This module is imported at interpreter start-up: it must stay free of torch and of ``epcomm`` (whose
``__init__`` imports torch). It only locates ``epcomm`` (``importlib.util.find_spec`` does not import
it) when something imports ``deep_ep``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

VARIABLE = "EPCOMM_AS_DEEP_EP"
NAME = "deep_ep"
PTH_NAME = "epcomm_as_deep_ep.pth"
SHIM_PACKAGE = "_deep_ep"  # the directory inside epcomm that is loaded as ``deep_ep``

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def switch_on(environ=None) -> bool:
    """Whether ``EPCOMM_AS_DEEP_EP`` asks for epcomm as ``deep_ep`` (``environ`` defaults to
    ``os.environ``); a value that is neither on nor off raises ``ValueError``."""
    raw = (os.environ if environ is None else environ).get(VARIABLE, "")
    v = raw.strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise ValueError(f"{VARIABLE} must be one of {_ON} (on) or {_OFF} (off), got {raw!r}")


def shim_dir() -> str | None:
    """The directory that is loaded as ``deep_ep`` (``epcomm/_deep_ep``), found without importing epcomm;
    None where epcomm is not importable."""
    spec = importlib.util.find_spec("epcomm")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        d = os.path.join(base, SHIM_PACKAGE)
        if os.path.isfile(os.path.join(d, "__init__.py")):
            return d
    return None


class DeepEPFinder:
    """A meta-path finder: answers ``import deep_ep`` with epcomm's ``_deep_ep`` package and leaves
    every other name alone (a plain class: ``importlib.abc`` costs start-up time for nothing)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        d = shim_dir()
        if d is None:
            return None
        return importlib.util.spec_from_file_location(NAME, os.path.join(d, "__init__.py"),
                                                      submodule_search_locations=[d])


def installed() -> bool:
    """Whether ``DeepEPFinder`` is on ``sys.meta_path`` in this process."""
    return any(f is DeepEPFinder for f in sys.meta_path)


_reported: list = []  # the bad values install() has reported in this process


def install() -> bool:
    """Put ``DeepEPFinder`` first on ``sys.meta_path`` if the switch is on; returns whether it is there.

    Called by the ``.pth`` line; callable by hand too (e.g. in a process started before the variable
    was set, after setting it). A ``deep_ep`` imported before this call stays what it was.

    A value that is neither on nor off leaves the switch off and is reported once per process, as one
    line on stderr (logger ``epcomm``), not raised: raised in a ``.pth`` line it would print a traceback
    from ``site`` for every hook file that runs it, and start every Python process of the environment
    that way."""
    try:
        on = switch_on()
    except ValueError as e:
        if str(e) not in _reported:
            _reported.append(str(e))
            import logging

            logging.getLogger("epcomm").error("epcomm: %s; import deep_ep is not answered by epcomm in this "
                                              "process", e)
        return False
    if not on:
        return False
    if not installed():
        sys.meta_path.insert(0, DeepEPFinder)
    return True


def real_deep_ep_origin() -> str | None:
    """Where a ``deep_ep`` other than epcomm's would be imported from (a real DeepEP), or None.

    Asks every finder on ``sys.meta_path`` except ours; imports nothing."""
    for finder in sys.meta_path:
        if finder is DeepEPFinder or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec(NAME, None)
        except (ImportError, ValueError):
            continue
        if spec is not None:
            locations = list(spec.submodule_search_locations or [])
            if spec.origin not in (None, "namespace"):
                return spec.origin
            return locations[0] if locations else NAME
    return None


def pth_files() -> list[str]:
    """The ``epcomm_as_deep_ep.pth`` files in this interpreter's site directories (normally one)."""
    import site

    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [p for d in dict.fromkeys(dirs) if os.path.isfile(p := os.path.join(d, PTH_NAME))]
