"""Triton's interpreter for CPU runs of the kernels: ``TRITON_INTERPRET=1`` (import this before
Triton loads), and a fix for Triton 3.6's interpreter under NumPy 2 (a kernel's int arguments are
1-element arrays there, and ``int()`` of one raises), so the stock wheel runs the kernels unpatched."""
import inspect as _inspect
import os

os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime import interpreter as _interp  # noqa: E402

_orig_patch = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _orig_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interp._patch_lang_tensor = _patch_lang_tensor


# Speed, not behaviour (Triton 3.6's interpreter; skipped where its internals differ): every call of a
# @triton.jit helper inside a kernel re-ran the language patch (``_patch_lang``: five
# ``inspect.getmembers`` of tl, tl.core, tl.tensor, tl.math, ...) although the kernel's launch had already
# patched those modules, and left its scope unrestored: a third of a CPU run's time. Here the launch patches
# tl and tl.core both (what any helper's globals may name), a helper called under it patches nothing, and
# the list of each module's builtins is taken once (they are the same objects every launch: the launch's
# scope puts them back when it ends).
_orig_patch_lang = getattr(_interp, "_patch_lang", None)
_active = []  # the launch scope in force, if any


class _Langs:
    """What ``_patch_lang`` reads of a function: its globals, here naming both language modules."""

    __globals__ = {"tl": _interp.tl, "core": _interp.tl.core}


def _patch_lang(fn):
    if _active:  # a helper inside a launch: the launch's patch is in force
        return _interp._LangPatchScope()
    scope = _orig_patch_lang(_Langs)
    restore = scope.restore

    def _restore():
        _active.clear()
        restore()

    scope.restore = _restore
    _active.append(scope)
    return scope


_builtins_of: dict = {}


def _patch_builtin(pkg, builder, scope):
    members = _builtins_of.get(pkg)
    if members is None:
        members = _builtins_of[pkg] = [(n, m) for n, m in _inspect.getmembers(pkg) if _interp.tl.core.is_builtin(m)]
    for name, member in members:
        _interp._patch_attr(pkg, name, member, builder, scope)


if all(hasattr(_interp, n) for n in ("_patch_lang", "_patch_builtin", "_patch_attr", "_LangPatchScope", "tl")):
    _interp._patch_lang = _patch_lang
    _interp._patch_builtin = _patch_builtin
