"""Triton's interpreter for CPU runs of the kernels: ``TRITON_INTERPRET=1`` (import this before
Triton loads), and a fix for Triton 3.6's interpreter under NumPy 2 (a kernel's int arguments are
1-element arrays there, and ``int()`` of one raises), so the stock wheel runs the kernels unpatched; and
replacements of a few of Triton's functions that give the same results in less time (below: the tests run every
kernel under the interpreter, its Python per program the larger part of their CPU)."""
import ast as _ast
import builtins as _builtins
import hashlib as _hashlib
import inspect as _inspect
import math as _math
import os
import textwrap as _textwrap

import numpy as _np

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


# Speed, not behaviour (Triton 3.6 and 3.7's interpreter; each function replaced only where Triton's is the one
# written against, by the hash of its source: elsewhere Triton's own runs). A kernel's Python runs once per program,
# and each of its operations builds Triton's type objects anew: a block type re-unwraps and re-validates its shape,
# a tensor makes a tl.tuple of constexprs for its shape (whose tuple type formats a name nobody reads), a NumPy dtype
# comes from a table built per call, and most unwrapping and dtype comparisons go the long way: about a third of
# a CPU run of the kernels. Here each shape's values are made once and shared (Triton never changes a shape in
# place: a tl.tuple is changed by ``_setitem`` only, which the interpreter never calls), the names are made when
# read, and the common cases are answered first, with what Triton's function returns for them.
_core = _interp.tl.core


def _source_is(fn, digests: tuple) -> bool:
    """Whether ``fn``'s source is one of those this module's replacement was written against."""
    try:
        src = _textwrap.dedent(_inspect.getsource(fn))
    except (OSError, TypeError):
        return False
    return _hashlib.sha1(src.encode()).hexdigest()[:12] in digests


_np_dtype_of: dict = {}
_stock_np_dtype = _interp._get_np_dtype


def _get_np_dtype(tt_dtype):
    if isinstance(tt_dtype, _core.block_type):
        tt_dtype = tt_dtype.element_ty
    if isinstance(tt_dtype, _core.pointer_type):
        return _stock_np_dtype(tt_dtype)
    got = _np_dtype_of.get(tt_dtype)
    if got is None:
        got = _np_dtype_of[tt_dtype] = _stock_np_dtype(tt_dtype)
    return got


_tensor_shapes: dict = {}  # a shape's ints -> (numel, the tl.tuple of constexprs a tensor of it has as its shape)


def _tensor_init(self, handle, type):
    self.handle = handle
    key = _builtins.tuple(type.shape) if type.is_block() else ()
    got = _tensor_shapes.get(key)
    if got is None:
        got = _tensor_shapes[key] = (_core.constexpr(_math.prod(key)), _core.tuple([_core.constexpr(s) for s in key]))
    self.numel, self.shape = got
    self.type = type
    self.dtype = type.scalar


_block_shapes: dict = {}  # a shape's ints -> (numel, the tl.tuple of them a block type has as its shape)
_stock_block_init = _core.block_type.__init__


def _block_ints(shape):
    """The ints of ``shape`` (a list, tuple or tl.tuple of ints or constexprs of ints, not empty), else None."""
    values = shape.values if type(shape) is _core.tuple else shape if type(shape) in (list, _builtins.tuple) else None
    if not values:
        return None
    ints = []
    for v in values:
        if type(v) is _core.constexpr:
            v = v.value
        if type(v) is not int:
            return None
        ints.append(v)
    return _builtins.tuple(ints)


def _block_init(self, element_ty, shape):
    key = _block_ints(shape)
    if key is None:  # (an empty or unusual shape: Triton's checks and errors)
        _stock_block_init(self, element_ty, shape)
        return
    got = _block_shapes.get(key)
    if got is None:
        got = _block_shapes[key] = (_core.validate_block_shape(key), _core.tuple(list(key)))
    self.element_ty = element_ty
    self.numel, self.shape = got


def _block_name(self):
    got = self.__dict__.get("name")
    return f"<{self.shape}, {self.element_ty}>" if got is None else got


def _set_name(self, value):
    self.__dict__["name"] = value


def _tuple_type_init(self, types, fields=None):
    self.types = types
    self.fields = fields or [""] * len(types)


def _tuple_type_name(self):
    got = self.__dict__.get("name")
    return "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + "]" if got is None else got


_stock_unwrap = _core._unwrap_if_constexpr
_AS_IS = (int, bool, float, str, type(None), _core.tensor)


def _unwrap_if_constexpr(o):
    t = type(o)
    if t is _core.constexpr:
        return o.value
    if t in _AS_IS:
        return o
    return _stock_unwrap(o)


_stock_dtype_eq = _core.dtype.__eq__


def _dtype_eq(self, other):
    if isinstance(other, _core.dtype):  # (which Triton's unwrapping leaves as it is)
        return self.name == other.name
    return _stock_dtype_eq(self, other)


_INT_NAMES = frozenset(_core.dtype.SINT_TYPES + _core.dtype.UINT_TYPES)


def _is_int(self):
    return self.name in _INT_NAMES


_semantic = _interp.TritonSemantic
_stock_computation_type = _semantic.computation_type_impl
_computation_types: dict = {}  # (both operands' types, which is a scalar, div or mod) -> the type they compute in


def _computation_type(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod):
    key = (type(a_ty), a_ty.name, a_is_scalar, type(b_ty), b_ty.name, b_is_scalar, div_or_mod)
    got = _computation_types.get(key)
    if got is None:  # (Triton's errors are raised each time: never kept)
        got = _computation_types[key] = _stock_computation_type(self, a_ty, a_is_scalar, b_ty, b_is_scalar,
                                                                div_or_mod)
    return got


# Every int32 add, sub and mul in a kernel also ran Triton's overflow check (``binary_op_sanitize_overflow_impl``:
# the operation again in int64, two comparisons and an and: up to a fifth of a kernel's CPU here), whose condition
# goes to ``device_assert``, which without ``debug`` returns before reading it; the interpreter's options never have
# ``debug`` (``InterpreterOptions``: Triton 3.6 and 3.7 alike). Skipped there; anywhere else Triton's runs.
_stock_sanitize_overflow = _semantic.binary_op_sanitize_overflow_impl


def _sanitize_overflow(self, lhs, rhs, binary_op):
    if self.builder is _interp.interpreter_builder and not self.builder.options.debug:
        return
    _stock_sanitize_overflow(self, lhs, rhs, binary_op)


# A reduction whose combine function is not one of Triton's own (sum, min, max, argmin, argmax) runs element by
# element in Python (``ReduceOps.generic_reduce``: two tl tensors and a call of the combine per element): most of
# the layout kernel's time under the interpreter, for ``tl.reduce(bits, 1, _or)``. A combine that is the bitwise or
# of its two arguments, on an integer tensor, is NumPy's ``bitwise_or.reduce`` over the same axis instead (or is
# exact, associative and commutative: the same bits in any order), its result shaped as Triton's loop shapes it.
_or_combines: dict = {}  # a combine's Python function -> whether it is ``return a | b`` of its two arguments


def _is_or_combine(combine_fn) -> bool:
    fn = getattr(combine_fn, "fn", None)
    got = _or_combines.get(fn)
    if got is None:
        try:
            tree = _ast.parse(_textwrap.dedent(_inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            tree = None
        got = _or_combines[fn] = tree is not None and _returns_or_of_args(tree.body[0])
    return got


def _returns_or_of_args(node) -> bool:
    if not isinstance(node, _ast.FunctionDef):
        return False
    a = node.args
    names = [x.arg for x in a.args]
    if len(names) != 2 or a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg or a.defaults:
        return False
    body = [b for b in node.body if not (isinstance(b, _ast.Expr) and isinstance(b.value, _ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], _ast.Return):
        return False
    v = body[0].value
    return (isinstance(v, _ast.BinOp) and isinstance(v.op, _ast.BitOr) and isinstance(v.left, _ast.Name)
            and isinstance(v.right, _ast.Name) and sorted([v.left.id, v.right.id]) == sorted(names))


_stock_reduce = _interp.ReduceOps.apply_impl


def _reduce(self, input):
    if len(input) == 1 and input[0].handle.data.dtype.kind in "iub" and _is_or_combine(self.combine_fn):
        data, axis = input[0].handle.data, self.axis
        if axis is None:  # (Triton's loop reduces the flattened tensor)
            data, axis = data.reshape(-1), 0
        out = _np.bitwise_or.reduce(data, axis=axis, keepdims=self.keep_dims)
        if self.axis is None and not self.keep_dims:
            out = out.item()
        return [self.to_tensor(out, input[0].dtype)]
    return _stock_reduce(self, input)


if _source_is(_interp._get_np_dtype, ("74e2c0b884e3",)):
    _interp._get_np_dtype = _get_np_dtype
if _source_is(_core.tensor.__init__, ("1f20709236e6",)) and _source_is(_core.tuple.__init__, ("7a3fe25df4c0",)):
    _core.tensor.__init__ = _tensor_init
if _source_is(_core.block_type.__init__, ("8c5506e30f29",)) and _source_is(_core.tuple.__init__, ("7a3fe25df4c0",)):
    _core.block_type.__init__ = _block_init
    _core.block_type.name = property(_block_name, _set_name)
if _source_is(_core.tuple_type.__init__, ("707614104505",)):  # (Triton 3.7 makes its name when read itself)
    _core.tuple_type.__init__ = _tuple_type_init
    _core.tuple_type.name = property(_tuple_type_name, _set_name)
if _source_is(_stock_unwrap, ("e9e3cb054942", "31368a0b466e")):
    _core._unwrap_if_constexpr = _unwrap_if_constexpr
if _source_is(_stock_dtype_eq, ("466ed3f0158d",)):
    _core.dtype.__eq__ = _dtype_eq
if _source_is(_core.dtype.is_int, ("4942002a9879",)) and all(
        isinstance(getattr(_core.dtype, n, None), list) for n in ("SINT_TYPES", "UINT_TYPES")):
    _core.dtype.is_int = _is_int
if _source_is(_stock_computation_type, ("cd80b9e67a04",)) and _source_is(_semantic.integer_promote_impl,
                                                                         ("a61559f10110",)):
    _semantic.computation_type_impl = _computation_type
if _source_is(_stock_sanitize_overflow, ("15efd5227d86",)) and _source_is(_semantic.device_assert, ("2fc22f98a002",)):
    _semantic.binary_op_sanitize_overflow_impl = _sanitize_overflow
if _source_is(_stock_reduce, ("9cbe77b5a383",)) and _source_is(_interp.ReduceOps.generic_reduce, ("fe610506de59",)) \
        and _source_is(_interp.ReduceScanOpInterface.to_tensor, ("621374e23c55",)):
    _interp.ReduceOps.apply_impl = _reduce
