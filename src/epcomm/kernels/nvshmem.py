"""NVSHMEM device calls for the internode kernels, behind a constexpr switch.

On a GPU (``SIM=False``) each helper calls torch's NVSHMEM Triton bindings
(``torch.distributed._symmetric_memory._nvshmem_triton``; the kernel that uses them must be wrapped in
``requires_nvshmem``, see :func:`nvshmem_kernel`). Under the Triton interpreter (``SIM=True``: the CPU
tests, ``TRITON_INTERPRET=1``) they are simulated with plain loads, stores and atomics into the peers'
buffers, which the CPU emulation (``testing/cpu_nvlink.py``) maps into every process at the same
address, so ``ptr_table[pe]`` is peer ``pe``'s symmetric buffer.

Addresses: every helper takes the table of symmetric-buffer bases (``ptr_table: int64[R]``), this
rank's index ``me``, the target PE and a byte offset into the symmetric buffer. NVSHMEM wants the
*local* symmetric address of the destination (it translates it to ``pe``'s copy), so on the GPU the
helpers use ``ptr_table[me] + offset``; the simulation writes ``ptr_table[pe] + offset``. Only
``ptr_table[me]`` must be valid on a GPU (entries of peers NVSHMEM cannot map may be 0).

Signals are NVSHMEM signal words: ``uint64``, 8-byte aligned, only ever increased by
``NVSHMEM_SIGNAL_ADD``. :func:`wait_signal` polls the low 32 bits with acquire loads and a deadline
(``common.wait_ge``: wrapped int32 arithmetic, errors name the phase and the peer), not with
``signal_wait_until``, which has no deadline.

Ordering, the one guarantee callers build on: :func:`put_signal` makes its data visible at ``pe``
before the signal moves (NVSHMEM's put-with-signal: one operation, the signal travels after the data
on the same queue pair); nothing orders an earlier plain :func:`put` before it but :func:`fence` (per
PE) or :func:`quiet` (every put this program issued, to all PEs, delivered). A kernel whose *last*
program signals for the puts of *all* programs calls :func:`quiet` in every program before the ticket
(``common.ticket_last_n``).

The simulation is as weak as that under the interpreter (``nvshmem_sim``: a put lands only when a
fence, quiet or wait of its program delivers it, or early at random; a signal to a PE that puts are
still pending to goes ahead of them, which then land late), so a kernel that signals before its data
is fenced reads stale data in tier 2. Compiled (the sm_90 compile check: ``SIM=True`` without the
interpreter), the simulation is plain stores, a CTA barrier and a release atomic (system scope) on the
signal.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap

import triton
import triton.language as tl

from . import nvshmem_sim as _sim
from .common import wait_ge

SIGNAL_ADD = tl.constexpr(5)  # NVSHMEM_SIGNAL_ADD
COPY_BLOCK = tl.constexpr(1024)  # bytes per step of the simulated copy


def _interpreted() -> bool:
    """Whether ``@triton.jit`` makes interpreted functions here (decided as Triton decides it)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # pragma: no cover - Triton before knobs


def _bindings():
    """torch's NVSHMEM Triton bindings and whether they are usable (they exist only where torch sees Triton and
    CUDA)."""
    try:
        from torch.distributed._symmetric_memory import _nvshmem_triton as nv
    except ImportError:  # pragma: no cover - torch without symmetric memory
        return None, False
    return nv, hasattr(nv, "putmem_signal_block")


# Compiled, the kernels name ``_nv`` in their GPU branches (Triton's dependency walk visits them): imported now.
# Interpreted, those branches never run, and importing the bindings imports TorchDynamo (about 2 s of CPU in every
# process that runs the kernels on CPU): they are imported when ``available()`` or ``nvshmem_kernel`` first asks.
_nv, _HAVE = (None, None) if _interpreted() else _bindings()


# The weak simulation (``nvshmem_sim``: Python, so only under the interpreter). Its calls are written
# ``getattr(_sim, "name")(...)``: Triton's dependency walk, which visits dead branches too, accepts a
# module and the getattr builtin but not a plain Python function (hence ``noqa: B009``).
WEAK = tl.constexpr(_interpreted())


def available() -> bool:
    """Whether torch's NVSHMEM Triton bindings are importable here (a GPU build of torch with Triton)."""
    global _nv, _HAVE
    if _HAVE is None:
        _nv, _HAVE = _bindings()
    return _HAVE


def nvshmem_kernel(fn, sim: bool):
    """``fn`` (a ``@triton.jit`` kernel) as it must be launched: through ``requires_nvshmem`` on a GPU
    (links libnvshmem_device.bc and initialises the module for NVSHMEM), as it is in the simulation.

    Only a kernel that makes an NVSHMEM device call (:func:`makes_device_calls`) may be wrapped: torch initialises
    every module it compiles for NVSHMEM, and a module without NVSHMEM's symbols fails there
    (``nvshmemx_cumodule_init failed. Error code: 7``) at its first launch on a GPU. A kernel that only polls its own
    memory (a signal word) is a plain Triton kernel. Checked here on every machine, the simulation's included."""
    if not makes_device_calls(fn):
        name = getattr(getattr(fn, "fn", fn), "__name__", fn)
        raise ValueError(f"{name} makes no NVSHMEM device call (put, get, put_signal, signal_add, quiet, fence): "
                         "launch it as a plain Triton kernel, not through nvshmem_kernel (torch's module "
                         "initialisation for NVSHMEM fails on a module without NVSHMEM symbols)")
    if sim:
        return fn
    if not available():
        raise ImportError("torch's NVSHMEM Triton bindings are unavailable (torch.distributed._symmetric_memory."
                          "_nvshmem_triton needs a CUDA build of torch with Triton and the nvidia-nvshmem wheel)")
    return _nv.requires_nvshmem(fn)


@triton.jit
def _sym(ptr_table, rank, offset_bytes):
    """``uint8*`` at ``offset_bytes`` into rank ``rank``'s symmetric buffer."""
    return tl.load(ptr_table + rank).to(tl.pointer_type(tl.uint8)) + offset_bytes


@triton.jit
def _copy(dst, src, nbytes):
    """Byte copy in ``COPY_BLOCK`` steps (the simulation's put)."""
    cc = tl.arange(0, COPY_BLOCK)
    for o in range(0, nbytes, COPY_BLOCK):
        m = (o + cc) < nbytes
        tl.store(dst + o + cc, tl.load(src + o + cc, mask=m), mask=m)


@triton.jit
def put(ptr_table, me, pe, dst_off, src, nbytes, SIM: tl.constexpr):
    """Copy ``nbytes`` from local ``src`` (a pointer into this rank's symmetric buffer) to ``dst_off``
    of ``pe``'s symmetric buffer; block-scoped, returns when ``src`` may be reused (not delivered: see
    :func:`quiet`)."""
    s = src.to(tl.pointer_type(tl.uint8))
    if SIM:
        if WEAK:
            tl.debug_barrier()
            getattr(_sim, "put")(_sym(ptr_table, pe, dst_off), s, nbytes, pe,  # noqa: B009
                                 tl.program_id(0), tl.program_id(1), tl.program_id(2))
        else:
            _copy(_sym(ptr_table, pe, dst_off), s, nbytes)
    else:
        _nv.putmem_block_extern_wrapper(_sym(ptr_table, me, dst_off).to(tl.int64), s.to(tl.int64),
                                        nbytes + tl.zeros((), tl.int64), pe + tl.zeros((), tl.int32))


@triton.jit
def get(ptr_table, me, pe, dst_off, src_off, nbytes, SIM: tl.constexpr):
    """Copy ``nbytes`` from ``src_off`` of ``pe``'s symmetric buffer to ``dst_off`` of this rank's; block-scoped
    and non-blocking on a GPU (``nvshmemx_getmem_nbi_block``: the data is there after :func:`quiet`). NVSHMEM
    takes the *local* symmetric address of the source. Simulated: a plain copy from the peer's mapping (what a
    peer wrote before the barrier that preceded this kernel)."""
    if SIM:
        _copy(_sym(ptr_table, me, dst_off), _sym(ptr_table, pe, src_off), nbytes)
    else:
        _nv.getmem_nbi_block_extern_wrapper(_sym(ptr_table, me, dst_off).to(tl.int64),
                                            _sym(ptr_table, me, src_off).to(tl.int64),
                                            nbytes + tl.zeros((), tl.int64), pe + tl.zeros((), tl.int32))


@triton.jit
def put_signal(ptr_table, me, pe, dst_off, src, nbytes, sig_off, SIM: tl.constexpr):
    """:func:`put`, then add 1 to the uint64 signal at ``sig_off`` of ``pe``'s buffer; the data is
    visible at ``pe`` before the signal moves. ``nbytes`` may be 0 (a bare ordered signal)."""
    s = src.to(tl.pointer_type(tl.uint8))
    if SIM:
        if WEAK:
            tl.debug_barrier()
            getattr(_sim, "put_signal_data")(_sym(ptr_table, pe, dst_off), s, nbytes, pe)  # noqa: B009
        else:
            _copy(_sym(ptr_table, pe, dst_off), s, nbytes)
        tl.debug_barrier()
        sig = _sym(ptr_table, pe, sig_off).to(tl.pointer_type(tl.int64))
        tl.atomic_add(sig, 1, sem="release", scope="sys")
    else:
        # every scalar as a tensor of the binding's type (a literal or a specialised 1 would be a constexpr)
        _nv.putmem_signal_block(_sym(ptr_table, me, dst_off), s, nbytes + tl.zeros((), tl.int64),
                                _sym(ptr_table, me, sig_off), tl.full((), 1, tl.int64),
                                tl.full((), SIGNAL_ADD, tl.int32), pe + tl.zeros((), tl.int32))


@triton.jit
def signal_add(ptr_table, me, pe, sig_off, value, SIM: tl.constexpr):
    """Add ``value`` to the uint64 signal at ``sig_off`` of ``pe``'s buffer (a put-with-signal of no data).
    Unlike :func:`put_signal`'s own data, this program's earlier plain puts to ``pe`` are ordered before it
    only by a :func:`fence` or :func:`quiet` between them (the simulation lets the signal overtake them)."""
    here = _sym(ptr_table, me, sig_off)
    if SIM:
        if WEAK:
            tl.debug_barrier()
            getattr(_sim, "put_signal_data")(here, here, 0, pe)  # noqa: B009
        tl.debug_barrier()
        sig = _sym(ptr_table, pe, sig_off).to(tl.pointer_type(tl.int64))
        tl.atomic_add(sig, value + tl.zeros((), tl.int64), sem="release", scope="sys")
    else:
        _nv.putmem_signal_block(here, here, tl.zeros((), tl.int64), here, value + tl.zeros((), tl.int64),
                                tl.full((), SIGNAL_ADD, tl.int32), pe + tl.zeros((), tl.int32))


@triton.jit
def quiet(SIM: tl.constexpr):
    """Every put this program issued is delivered."""
    if SIM:
        if WEAK:
            getattr(_sim, "quiet")(tl.program_id(0), tl.program_id(1), tl.program_id(2))  # noqa: B009
    else:
        _nv.quiet()
    tl.debug_barrier()


@triton.jit
def fence(SIM: tl.constexpr):
    """Puts issued before reach each PE before puts issued after (per PE, not across PEs)."""
    if SIM:
        if WEAK:
            getattr(_sim, "fence")(tl.program_id(0), tl.program_id(1), tl.program_id(2))  # noqa: B009
    else:
        _nv.fence()
    tl.debug_barrier()


@triton.jit
def wait_signal(ptr_table, me, sig_off, target, err_ptr, phase, peer, timeout_ns, HAS_TIMER: tl.constexpr,
                mask_ptr=None, SHRINK: tl.constexpr = False):
    """Wait until this rank's uint64 signal at ``sig_off`` reaches ``target`` (low 32 bits, wrapped;
    acquire) or the deadline: ``common.wait_ge`` on the signal's low word (little-endian)."""
    if WEAK:
        getattr(_sim, "progress")()  # noqa: B009
    low = _sym(ptr_table, me, sig_off).to(tl.pointer_type(tl.int32))
    return wait_ge(low, target, err_ptr, phase, peer, timeout_ns, HAS_TIMER, mask_ptr, SHRINK)


_DEVICE_CALLS = (put, get, put_signal, signal_add, quiet, fence)  # the helpers that call NVSHMEM on a GPU
_CALLS_SEEN: dict = {}


def makes_device_calls(fn) -> bool:
    """Whether the ``@triton.jit`` function ``fn`` calls one of this module's NVSHMEM helpers (:func:`put`,
    :func:`get`, :func:`put_signal`, :func:`signal_add`, :func:`quiet`, :func:`fence`), itself or through the jit
    functions it calls (found in its source, by the names it calls, resolved in its module)."""
    py = getattr(fn, "fn", fn)
    if py not in _CALLS_SEEN:
        _CALLS_SEEN[py] = False  # (a cycle ends here)
        _CALLS_SEEN[py] = any(t in _DEVICE_CALLS or makes_device_calls(t) for t in _called_jit(py))
    return _CALLS_SEEN[py]


def _called_jit(py) -> list:
    """The jit functions of epcomm's kernels that the function ``py`` calls by name (``f(...)``, ``mod.f(...)``)."""
    out, g = [], py.__globals__
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(py)))):
        if not isinstance(node, ast.Call):
            continue
        f, target = node.func, None
        if isinstance(f, ast.Name):
            target = g.get(f.id)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            target = getattr(g.get(f.value.id), f.attr, None)
        inner = getattr(target, "fn", None)
        if callable(inner) and getattr(inner, "__module__", "").startswith(__name__.rsplit(".", 1)[0]):
            out.append(target)
    return out
