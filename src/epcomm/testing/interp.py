"""Triton's interpreter for CPU runs of the kernels: ``TRITON_INTERPRET=1`` (import this before
Triton loads), and a fix for Triton 3.6's interpreter under NumPy 2 (a kernel's int arguments are
1-element arrays there, and ``int()`` of one raises), so the stock wheel runs the kernels unpatched."""
import os

os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime import interpreter as _interp  # noqa: E402

_orig_patch = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _orig_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interp._patch_lang_tensor = _patch_lang_tensor
