"""Launch parameters and host-side arithmetic of the nvlink backend's high-throughput path: the
``TUNE`` table (``EPCOMM_TUNE`` overrides it), the copy-engine chunking, counter and ticket
slots, and small pure helpers. No CUDA calls; ``backends/nvlink.py`` uses it.

Letters: ``T`` tokens, ``R`` ranks, ``L = E/R`` local experts, ``C`` channels.
"""

from __future__ import annotations

import os

import torch

from ..kernels.launch import Ptr

L_MAX = 1024
C_MAX = 128
T_LIST_CAP = 32768
DEFAULT_NVL_BYTES = 256 << 20
NUM_CTRS = 16
# launch parameters of the high-throughput kernels (a variant: EPCOMM_TUNE=<key>=<value> epcomm bench)
TUNE = dict(gather_rb=16, gather_block=1024, gather_warps=16, gather_stages=1, reduce_tb=16, reduce_block=512,
            reduce_warps=16, reduce_stages=3, notify_block=2048, notify_warps=8, push_rb=16, push_block=1024,
            cpush_rb=8, cpush_block=512, ce_chunks=4, ce_chunks_sync=0)
# notify_block: tokens a step of the exchange kernel's rank programs (a scan over all T tokens, one step after
# another): 2048 took 2.4-2.8 us off the DSv3 graph dispatch (BF16 110.9 -> 108.1, FP8 83.9 -> 81.6 us, the
# mean of 2 rounds at world 1, one H100; 4096 with 16 warps: 108.9 / 82.0; commit df5aedb)
# push_rb / push_block: the SM push's tiles (the dispatch's receive kernel pushes this rank's rows while it
# copies its own block: graph dispatch 525 -> 433 us BF16, 396 -> 352 FP8 against a push kernel of its own on
# nvidia-h200-x2, 3812ed8); cpush_rb / cpush_block: the combine kernel's push, before its reduce, in one
# launch (tiles chosen with the since-deleted ht_probe on nvidia-h200-x2, DSv3 shape, 24 SMs, graph replays,
# 2026-11-22: tiles of 64 KB per step keep enough bytes in flight per SM; graph dispatch BF16 441 -> 370 us,
# FP8 355 -> 294 us, combine 360 -> 349 us against 8 x 512-word tiles)
NC = 4  # copy-engine chunks per transfer (the receiver starts on chunk c while c+1 is in flight)
# deadlines on %globaltimer; under the Triton interpreter (CPU runs of the backend, epcomm.testing.cpu_nvlink)
# the waits count spins instead
TIMER = os.environ.get("TRITON_INTERPRET") != "1"


SMEM_BUDGET = 200 << 10  # bytes of shared memory a pipelined kernel may plan for (H100/H200: 227 KB per block)


def reduce_stages(r_pow2: int, tb: int, block: int, stages: int | None = None) -> int:
    """Pipeline depth of the combine's reduce kernel for ``R_POW2`` ranks: ``TUNE["reduce_stages"]``, or 1
    (no pipelining) where its buffers would not fit. The kernel loads ``2 * R_POW2`` tiles of
    ``tb x block`` bf16 per step and keeps ``stages - 1`` steps in flight in shared memory: 3 stages of
    16 x 512 need 256 KB at 4 ranks, an out-of-resources error at launch. the since-deleted kernel_bench on one
    H200 (16 x 512 tiles, 24 programs, 4096 tokens): 3 stages best at 2 ranks (165 us against 195 for
    1), 1 stage best at 4 ranks (271 us against 375 for 2) and at 8 (496 us)."""
    s = TUNE["reduce_stages"] if stages is None else stages
    return s if (s - 1) * 2 * r_pow2 * tb * block * 2 <= SMEM_BUDGET else 1


def apply_tune(overrides: dict[str, str], table: dict | None = None, prefix: str = "") -> None:
    """Set entries of ``table`` (default: ``TUNE``) from ``EPCOMM_TUNE`` strings, each converted to its
    default's type (``prefix``: how the keys are written in the variable, e.g. ``ll.``)."""
    table = TUNE if table is None else table
    for key, val in overrides.items():
        if key not in table:
            known = ", ".join(prefix + k for k in sorted(table))
            raise ValueError(f"EPCOMM_TUNE: unknown key {prefix + key!r} (known: {known})")
        kind = type(table[key])
        if kind is bool:
            if val.lower() not in ("1", "0", "true", "false"):
                raise ValueError(f"EPCOMM_TUNE: {prefix + key} must be 0/1/true/false, got {val!r}")
            table[key] = val.lower() in ("1", "true")
        elif kind is int:
            try:
                table[key] = int(val)
            except ValueError:
                raise ValueError(f"EPCOMM_TUNE: {prefix + key} must be an integer, got {val!r}") from None
        else:
            table[key] = val


def _chunk_rows(rows: int) -> int:
    """Rows per ``NC``-chunk of a block of ``rows`` (the receiver's unit: its kernels use this formula)."""
    return max((rows + NC - 1) // NC, 1)


def _ce_step(synchronised: bool = False) -> int:
    """How many ``NC``-chunks each copy-engine copy carries (``NC // TUNE["ce_chunks"]``; the receiver's
    levels count ``NC``-chunks either way, so fewer, larger copies only raise the flag by more at a time).
    ``synchronised``: a dispatch whose gather starts only after the host synchronisation, by when the
    copies are usually done; ``TUNE["ce_chunks_sync"]`` (0: as ``ce_chunks``) may then use fewer
    copies and flag kernels, i.e. fewer launches before the synchronisation."""
    n = TUNE["ce_chunks_sync"] if synchronised and TUNE["ce_chunks_sync"] else TUNE["ce_chunks"]
    if n not in (1, 2, 4) or NC % n:
        raise ValueError(f"TUNE['ce_chunks'] / TUNE['ce_chunks_sync'] must divide NC={NC}, got {n}")
    return NC // n


# counter slots (local int32 device memory)
DSEND, DRECV, CSEND, CRECV = 0, 1, 2, 3
# ticket slots
T_GATHER, T_REDUCE, T_DPUSH, T_CPUSH = 0, 1, 2, 3


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): ``_pow2(5) == 8``, ``_pow2(8) == 8``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _host_counts(vals, r_: int, lx: int, alignment: int):
    """From the words the exchange kernel wrote for the host (``[rank_prefix_matrix[:, me] (R)][rows per local
    expert (L)]``, ``ht_notify._host_done``; a NumPy view of the pinned words, or any sequence): the inclusive
    prefix of the rows from ranks ``0..i``, the rows this rank receives, and the per-expert list rounded up to
    ``alignment``, as Python ints: one conversion, then at most one list operation.

    Example: ``_host_counts([1, 5, 4, 1], 2, 2, 2) == ([1, 5], 5, [4, 2])``.
    """
    v = vals[:r_ + lx]
    v = v.tolist() if hasattr(v, "tolist") else list(v)  # one C call from a NumPy view; then Python ints
    prefix, pe = v[:r_], v[r_:]
    if alignment != 1:
        pe = [(n + alignment - 1) // alignment * alignment for n in pe]
    return prefix, prefix[-1], pe


def layout_launch(k: int, e: int, r_: int) -> tuple[int, int, dict]:
    """The layout kernel's groups per token chunk, its number of rank groups and its constexprs for top-k
    ``k``, ``e`` experts and ``r_`` ranks: rank groups of up to 8 ranks, expert groups of up to 32 experts,
    tiles of ``TBE`` tokens (about 1024 ids) in expert programs and ``TBR`` in rank programs (at most
    ``TBE``, and ``TBR * K_POW2 * RB <= 4096``), at most ``CP2`` = 32 token chunks. A call on ``T`` tokens
    launches ``chunks * groups`` programs, ``(chunks, S) = kernels.ht_layout.chunking(T, TBE, CP2)``.

    Example: ``layout_launch(8, 256, 2) == (9, 1, dict(K_POW2=8, RB=2, EB=32, TBR=128, TBE=128, CP2=32))``:
    one rank group, eight of 32 experts each; at ``T = 4096``, 32 chunks of 128 tokens, 288 programs."""
    kp, rb, eb = _pow2(k), min(_pow2(r_), 8), min(_pow2(e), 32)
    nr = (r_ + rb - 1) // rb
    tbe = max(1, 1024 // kp)
    return nr + (e + eb - 1) // eb, nr, dict(K_POW2=kp, RB=rb, EB=eb, TBR=min(tbe, max(1, 4096 // (kp * rb))),
                                             TBE=tbe, CP2=32)


def _aligned(*tensors) -> int:
    """Bit ``i`` set where per-call tensor ``i`` (or None) is not 16-byte aligned: Triton specialises a
    kernel on its pointers' alignment, so this joins the launch key (kernels/launch.py)."""
    bits = 0
    for i, t in enumerate(tensors):
        if t is not None and type(t) is not Ptr and t.data_ptr() & 15:
            bits |= 1 << i
    return bits


_TL: dict = {}


def torch_to_tl(dtype: torch.dtype):
    """The Triton element type of a word dtype (``torch.int32 -> tl.int32``), looked up once."""
    if not _TL:
        import triton.language as tl

        _TL.update({torch.int32: tl.int32, torch.int16: tl.int16, torch.uint8: tl.uint8})
    return _TL[dtype]


def _contiguous(t):
    """``t`` itself where it is contiguous (or None), else a contiguous copy (no torch call for the
    common case: each counts in the host budget)."""
    return t if t is None or t.is_contiguous() else t.contiguous()
