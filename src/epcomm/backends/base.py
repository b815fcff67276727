"""The interface every transport implements. ``Buffer`` validates, owns streams, and delegates here.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``N`` received tokens, ``M`` low-latency max tokens per rank, ``G = H/128`` FP8 scale groups.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch

from ..config import Config
from ..layout import DispatchHandle, LowLatencyHandle
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


def bad_expert_id(be, word: list) -> int | None:
    """The error word ``word`` read at a high-throughput dispatch's host synchronisation: a bad expert id
    (code 10; the layout ignored it, so every rank still completes the call and the Buffer stays in step)
    is returned with the word cleared, for the call to raise once it is done; any other error raises now
    (``be._check_error``)."""
    if word[0] == 10:
        be.err[:4].zero_()
        be.err_host.zero_()
        return word[2]
    if word[0]:
        be._check_error(word)
    return None


def raise_error_word(be, word: list, announced_ms: Callable[[], list] | None = None, waited: str = "flag") -> None:
    """Raise what a kernel recorded in the error word ``word = [code, peer, observed, target]`` of backend
    ``be`` (its ``rank`` and ``timeout_s`` name the error); nothing if ``code`` is 0.

    Codes: 10 a bad expert id (``observed``; ``target`` is num_experts), 9 more tokens arrived than
    ``num_worst_tokens`` (``observed`` > ``target``), 11 a rank's ``num_tokens_per_rank`` disagrees with
    its ``is_token_in_rank``, any other a wait that passed its deadline (``kernels.common.PHASES``).
    A low-latency receive that timed out (6) first asks ``announced_ms()`` for every rank's
    ``num_max_dispatch_tokens_per_rank`` (0: a rank that has made no low-latency call): ranks that
    disagree are the cause, named as such. ``waited``: what the deadline was waiting on ("flag",
    "signal"), for the message."""
    code = word[0]
    if not code:
        return
    if code == 10:
        raise ValueError(f"topk_idx holds expert id {word[2]}, outside [-1, {word[3]}) for num_experts={word[3]} "
                         "(found on the device; this Buffer is now unusable)")
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
    """Transport interface. Every method runs on the current stream (``Buffer`` picks it).

    Low-latency methods send and return ``(result, receive)``: the result's tensors are allocated
    already, and calling ``receive()`` fills them (this split is what ``return_recv_hook`` exposes).
    """

    name = "abstract"

    def __init__(self, group, rank: int, num_ranks: int, device: torch.device, timeout_s: float):
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self.device = device
        self.timeout_s = timeout_s

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        raise NotImplementedError

    def cached_dispatch(self, x: torch.Tensor, x_scales: torch.Tensor | None, handle: DispatchHandle,
                        config: Config | None = None):
        """Returns ``(recv_x, recv_x_scales)`` laid out as the dispatch that made ``handle``. ``config``: the
        call's (None: the backend's choice)."""
        raise NotImplementedError

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None,
                bias: tuple[torch.Tensor, ...], config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

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
