"""The interface every transport implements. ``Buffer`` validates, owns streams, and delegates here.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``N`` received tokens, ``M`` low-latency max tokens per rank, ``G = H/128`` FP8 scale groups.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch

from ..config import Config
from ..layout import DispatchHandle, LowLatencyHandle, dispatch_layout
from .errors import PeerLostError, PeerTimeoutError, gave_up  # noqa: F401 (re-exported; their home is errors.py)


@dataclasses.dataclass
class DispatchArgs:
    """A validated high-throughput dispatch (non-cached)."""

    x: torch.Tensor                      # bf16[T, H] or fp8[T, H]
    x_scales: torch.Tensor | None        # f32[T, G] with FP8, else None
    topk_idx: torch.Tensor | None        # int64[T, K]
    topk_weights: torch.Tensor | None    # f32[T, K]
    num_tokens_per_rank: torch.Tensor    # int32[R]
    is_token_in_rank: torch.Tensor       # bool[T, R]
    num_tokens_per_expert: torch.Tensor  # int32[E]
    expert_alignment: int
    num_worst_tokens: int
    num_channels: int
    num_sms: int
    rdma_chunk: int = 0                  # Config.num_max_rdma_chunked_send_tokens (0: the backend's choice)


class DispatchResult(NamedTuple):
    recv_x: torch.Tensor
    recv_x_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert_list: list
    handle: DispatchHandle


@dataclasses.dataclass
class LowLatencyDispatchArgs:
    x: torch.Tensor                      # bf16[T, H]
    topk_idx: torch.Tensor               # int64[T, K]
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    cumulative_local_expert_recv_stats: torch.Tensor | None
    dispatch_wait_recv_cost_stats: torch.Tensor | None
    parity: int                          # which of the two receive areas this call uses
    mask: torch.Tensor | None = None     # the Buffer's int32[R] mask (1 = masked) when enable_shrink, else
    #                                      None; device backends also mask a peer that misses its deadline
    hook: bool = False                   # return_recv_hook: the receive must wait for hook() (else a
    #                                      backend may send and receive in one launch)


class LowLatencyDispatchResult(NamedTuple):
    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    recv_count: torch.Tensor
    handle: LowLatencyHandle


@dataclasses.dataclass
class LowLatencyCombineArgs:
    x: torch.Tensor                      # bf16[L, R*M, H]
    topk_idx: torch.Tensor               # int64[T, K]
    topk_weights: torch.Tensor           # f32[T, K]
    handle: LowLatencyHandle
    out: torch.Tensor | None             # bf16[T, H]
    combine_wait_recv_cost_stats: torch.Tensor | None
    parity: int
    mask: torch.Tensor | None = None
    hook: bool = False                   # return_recv_hook (as in LowLatencyDispatchArgs)


def checked_run(run: Callable, err_view, check: Callable[[], None]) -> Callable:
    """``run`` (a backend's ``low_latency_*_run``) behind the check of its error word's host mirror
    ``err_view`` (a numpy view: no torch call per repeat); ``check()`` raises what it holds."""

    def checked(*tensors):
        if err_view[0]:
            check()
        return run(*tensors)

    return checked


def input_error(be, word: list) -> ValueError | None:
    """The error word ``word`` read at a high-throughput dispatch's host synchronisation: an input error the
    kernels found while the exchange still ran to its end on every rank, so that the Buffer stays in step (a bad
    expert id, code 10: the layout ignored it; an ``is_token_in_rank`` that is not the layout of the ids, code 12)
    is returned as the ``ValueError`` for the call to raise once it is done, with the word cleared; any other
    error raises now (``be._check_error``). None: no error."""
    if word[0] in (10, 12):
        be.err[:4].zero_()
        be.err_host.zero_()
        return ValueError(_input_message(word))
    if word[0]:
        be._check_error(word)
    return None


def _input_message(word: list) -> str:
    """The message of input error 10 or 12 of the error word ``word``."""
    if word[0] == 10:
        return f"topk_idx holds expert id {word[2]}, outside [-1, {word[3]}) for num_experts={word[3]}"
    return (f"is_token_in_rank does not match topk_idx at token {word[2]}, rank {word[3]}: pass the layout "
            "get_dispatch_layout made from this topk_idx")


def raise_error_word(be, word: list, announced_ms: Callable[[], list] | None = None, waited: str = "flag") -> None:
    """Raise what a kernel recorded in the error word ``word = [code, peer, observed, target]`` of backend
    ``be`` (its ``rank`` and ``timeout_s`` name the error); nothing if ``code`` is 0.

    Codes: 10 a bad expert id (``observed``; ``target`` is num_experts), 9 more tokens arrived than
    ``num_worst_tokens`` (``observed`` > ``target``), 11 a rank's ``num_tokens_per_rank`` disagrees with
    its ``is_token_in_rank``, 12 ``is_token_in_rank`` is not the layout of ``topk_idx`` (at token ``observed``,
    rank ``target``), any other a wait that passed its deadline (``kernels.common.PHASES``).
    A low-latency receive that timed out (6) first asks ``announced_ms()`` for every rank's
    ``num_max_dispatch_tokens_per_rank`` (0: a rank that has made no low-latency call): ranks that
    disagree are the cause, named as such. ``waited``: what the deadline was waiting on ("flag",
    "signal"), for the message."""
    code = word[0]
    if not code:
        return
    if code in (10, 12):
        raise ValueError(f"{_input_message(word)} (found on the device; this Buffer is now unusable)")
    if code == 9:
        raise RuntimeError(f"epcomm rank {be.rank}: num_worst_tokens={word[3]} but {word[2]} tokens arrived; "
                           "raise num_worst_tokens (this Buffer is now unusable)")
    if code == 11:
        raise ValueError(f"num_tokens_per_rank on rank {word[1]} says {word[2]} tokens for a rank to which its "
                         f"is_token_in_rank sends {word[3]} (found on the device; this Buffer is now unusable)")
    if code < 0 or word[1] < 0:
        # record_error writes positive codes and a real rank; anything else is a word that was overwritten
        # (a kernel writing out of bounds, or launches replayed outside their calls), not a peer's timeout
        raise RuntimeError(f"epcomm rank {be.rank}: the device error word reads {list(word)}, which no epcomm "
                           "kernel records (codes are positive, the peer a rank): the error area was "
                           "overwritten; this Buffer is now unusable")
    if code == 6 and announced_ms is not None:
        ms = announced_ms()
        if len({m for m in ms if m}) > 1:
            raise ValueError("num_max_dispatch_tokens_per_rank differs across ranks: "
                             + ", ".join(f"{m} on rank {r}" for r, m in enumerate(ms)))
    from ..kernels.common import PHASES

    raise PeerTimeoutError(be.rank, PHASES.get(code, f"phase {code}"), word[1], be.timeout_s,
                           f"{waited} {word[2]} < expected {word[3]}; this Buffer is now unusable",
                           group=getattr(be, "group", None))


def wait_work(be, work, phase: str, poll: bool) -> None:
    """Wait for the ``torch.distributed`` work ``work`` of backend ``be`` within ``be.timeout_s``; past it
    raise ``PeerTimeoutError`` naming ``phase`` (``deadline.wait``). ``poll``: NCCL work, which completes on
    the GPU (polled, so the host never blocks forever; the group is aborted after the deadline); else
    gloo's, which should be issued with the deadline itself (``deadline.issue_*``), so that nothing of it
    stays queued in the group when it expires."""
    from . import deadline

    device = be.device if poll else torch.device("cpu")
    deadline.wait(work, be.group, device, be.rank, phase, be.timeout_s)


class Backend:
    """Transport interface: every member a front end (``Buffer``, ``ElasticBuffer``) uses is declared here.
    Every method runs on the current stream (the front end picks it).

    Three kinds of members:

    - **Calls** (``dispatch``, ``cached_dispatch``, ``combine``, ``low_latency_dispatch`` /
      ``low_latency_combine``, ``return_rows``): every backend implements them; they run one call.
    - **Plans** (``dispatch_run``, ``cached_dispatch_run``, ``combine_run``, ``low_latency_*_run``,
      ``row_parts_kind`` / ``rows_kind``): ``run`` for every later call of the same kind (same shapes,
      dtypes, flags, ``Config`` and 16-byte alignment; contiguous tensors), made once by the first call.
      The front end keeps it and calls it on repeats without its checks. The default, None, means "call
      the call every time": a backend without plans is complete.
    - **Facts** (``name``, ``checks_topk_on_device``, ``nvl_buffer`` / ``rdma_buffer``): read by the
      front end once.

    Low-latency calls send and return ``(result, receive)``: the result's tensors are allocated
    already, and calling ``receive()`` fills them (this split is what ``return_recv_hook`` exposes).
    """

    name = "abstract"
    # True where the backend's kernels check expert ids themselves (a bad id raises at the next
    # synchronisation); False: the front end checks them on the host before every call
    checks_topk_on_device: bool = False
    nvl_buffer: torch.Tensor | None = None   # uint8 views behind Buffer.get_local_buffer_tensor
    rdma_buffer: torch.Tensor | None = None

    def __init__(self, group, rank: int, num_ranks: int, device: torch.device, timeout_s: float):
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self.device = device
        self.timeout_s = timeout_s

    # ------------------------------------------------------------------ high-throughput

    def dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, scratch_counts: bool = False):
        """``topk_idx int64[T, K]`` -> ``(num_tokens_per_rank int32[R], num_tokens_per_expert int32[E],
        is_token_in_rank bool[T, R])``. ``scratch_counts``: the caller reads the counts before its next
        call, so a backend may return its own scratch for them. Default: the routing math in torch
        (``layout.dispatch_layout``); a backend with a layout kernel overrides it."""
        return dispatch_layout(topk_idx, num_experts, self.num_ranks)

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        raise NotImplementedError

    def fuses_layout(self, capturing: bool = False) -> bool:
        """Whether :meth:`dispatch_run` can compute the layout itself (``fused_layout=True``) for a call that
        is (``capturing``) or is not being captured into a CUDA graph. Default: no."""
        return False

    def dispatch_run(self, args: DispatchArgs, scratch_rows: int = 0, fused_layout: bool = False) -> Callable | None:
        """The plan of every dispatch like ``args``: ``run(x, x_scales, topk_idx, topk_weights,
        num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert) -> DispatchResult``, or None (then
        :meth:`dispatch` every time). ``scratch_rows`` (``ElasticBuffer``'s dispatches: at least the rows a
        call can receive): the result's ``recv_topk_idx`` and the handle's channel matrices may be the
        backend's scratch, rewritten by the next such call. ``fused_layout`` (only where
        :meth:`fuses_layout`): the plan computes the layout from ``topk_idx``, and ``run``'s three layout
        arguments are not read."""
        return None

    def cached_dispatch_run(self, x: torch.Tensor, x_scales: torch.Tensor | None, handle: DispatchHandle,
                            config: Config | None = None) -> Callable | None:
        """The plan of every cached dispatch like this one: ``run(x, x_scales, handle) -> (recv_x,
        recv_x_scales)``, or None (then :meth:`cached_dispatch` every time)."""
        return None

    def combine_run(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None,
                    bias: tuple[torch.Tensor, ...], config: Config | None = None) -> Callable | None:
        """The plan of every combine like this one: ``run(x, handle, topk_weights, bias) -> (combined_x,
        combined_topk_weights)``, or None (then :meth:`combine` every time)."""
        return None

    def cached_dispatch(self, x: torch.Tensor, x_scales: torch.Tensor | None, handle: DispatchHandle,
                        config: Config | None = None):
        """Returns ``(recv_x, recv_x_scales)`` laid out as the dispatch that made ``handle``. ``config``: the
        call's (None: the backend's choice)."""
        raise NotImplementedError

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None,
                bias: tuple[torch.Tensor, ...], config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    # ------------------------------------------------------------------ low-latency

    def low_latency_dispatch(
        self, args: LowLatencyDispatchArgs
    ) -> tuple[LowLatencyDispatchResult, Callable[[], None]]:
        raise NotImplementedError

    def low_latency_combine(self, args: LowLatencyCombineArgs) -> tuple[torch.Tensor, Callable[[], None]]:
        raise NotImplementedError

    def low_latency_zero_copy_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        raise NotImplementedError

    def low_latency_dispatch_run(self, args: LowLatencyDispatchArgs) -> Callable | None:
        """Optional: ``run(x, topk_idx, cum, wst) -> (result, receive)``, doing what
        ``low_latency_dispatch`` does for every later call that differs from ``args`` only in its tensors
        (same shapes, dtypes, devices, alignment, flags and parity; contiguous). ``Buffer`` keeps it and
        calls it on such repeats without its checks. None: ``low_latency_dispatch`` every time."""
        return None

    def low_latency_combine_run(self, args: LowLatencyCombineArgs) -> Callable | None:
        """Optional, as :meth:`low_latency_dispatch_run`: ``run(x, topk_idx, topk_weights, out, wst) ->
        (combined, receive)`` for the combines like ``args`` (same handle object)."""
        return None

    # ------------------------------------------------------------------ ElasticBuffer's combine transport

    def return_rows(self, rows: torch.Tensor, dst: torch.Tensor, slots: int, phase: str,
                    num_sms: int = 0) -> torch.Tensor:
        """``ElasticBuffer``'s combine transport (DeepEP V2's API): row ``i`` of ``rows uint8[n, W]`` goes to
        rank ``dst[i] // slots``, slot ``dst[i] % slots`` (``dst int64[n]``, ``-1``: nowhere). Returns
        ``uint8[R, slots, W]``, block ``r`` from rank ``r`` (slots nobody wrote: unspecified bytes).

        Default: one ``all_to_all_single`` of equal splits over the group. Its shapes depend on ``slots``
        only, never on the routing: no host wait, capturable on NCCL. A backend may override it (``num_sms``:
        the programs its kernels may take, the same on every rank; 0: its choice)."""
        import torch.distributed as dist

        r_, dev, w = self.num_ranks, rows.device, rows.shape[1]
        send = torch.empty(r_ * slots + 1, w, dtype=torch.uint8, device=dev)
        send.index_copy_(0, torch.where(dst >= 0, dst, torch.full_like(dst, r_ * slots)), rows)
        send = send[:r_ * slots]
        if r_ == 1:
            return send.view(1, slots, w)
        staged = dev.type == "cuda" and "nccl" not in str(dist.get_backend(self.group)).lower()
        src = send.cpu() if staged else send
        recv = torch.empty_like(src)
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            dist.all_to_all_single(recv, src, group=self.group)  # NCCL under capture: no host wait
        else:
            from . import deadline

            # host waits in seconds (a simulated backend's timeout_s counts polls: its wait_s is seconds)
            wait_s = getattr(self, "wait_s", self.timeout_s)
            work = deadline.issue_all_to_all(self.group, recv, src, [slots] * r_, [slots] * r_, wait_s)
            poll = dev.type == "cuda" and not staged
            deadline.wait(work, self.group, dev if poll else torch.device("cpu"), self.rank, phase, wait_s)
        return recv.to(dev).view(r_, slots, w)

    def return_row_parts(self, x: torch.Tensor, wts: torch.Tensor | None, dst: torch.Tensor, slots: int,
                         phase: str, num_sms: int = 0, skip_self: bool = False) -> torch.Tensor | None:
        """:meth:`return_rows` of rows that are ``x bf16[n, H]`` and, where given, ``wts f32[n, K]`` side by
        side, read in place (no pack); ``skip_self``: this rank's own rows do not move (the reduction reads
        them from ``x``). None where the backend cannot: the caller packs the rows and calls
        :meth:`return_rows`."""
        return None

    def rows_kind(self, rows: torch.Tensor, slots: int, num_sms: int = 0):
        """The plan of every :meth:`return_rows` call like this one, as launches a native chain can join
        (``elastic_chains.combine_chain``), or None: the call is made every time."""
        return None

    def row_parts_kind(self, x: torch.Tensor, wts: torch.Tensor | None, slots: int, num_sms: int = 0,
                       skip_self: bool = False):
        """As :meth:`rows_kind`, for :meth:`return_row_parts`."""
        return None

    # ------------------------------------------------------------------ life cycle

    def clean_low_latency_buffer(self) -> None:
        """Reset the low-latency signal state (all ranks call it together)."""

    def destroy(self) -> None:
        """Release communication buffers."""

    # ------------------------------------------------------------------ DeepEP V2's experimental calls
    # Engram, pipeline send/recv and the AGRS all-gather session (``ElasticBuffer``: ``elastic_extras.py``). Each
    # returns the plan of one configuration (``engram.py``, ``pp.py``, ``agrs.py``); building it is collective
    # (its symmetric memory). The default is the reference plan, over ``torch.distributed``; nvlink and internode
    # override these three. ``comm``: the stream the plan may run on beside the caller's (None: the caller's).

    def engram_plan(self, cfg, comm=None):
        """The Engram plan for ``cfg`` (``engram.EngramConfig``)."""
        from .engram import ReferenceEngram

        return ReferenceEngram(self, cfg, comm)

    def pp_plan(self, cfg):
        """The pipeline send/recv plan for ``cfg`` (``pp.PPConfig``)."""
        from .pp import ReferencePP

        return ReferencePP(self, cfg)

    def agrs_plan(self, cfg, comm=None):
        """The AGRS session plan for ``cfg`` (``agrs.AGRSConfig``)."""
        from .agrs import ReferenceAGRS

        return ReferenceAGRS(self, cfg, comm)
