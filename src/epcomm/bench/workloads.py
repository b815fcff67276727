"""Benchmark inputs, the timed operations of each case, byte counts and the correctness check.

Letters: ``T`` tokens per rank, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``N`` received rows, ``M`` low-latency max tokens per rank (``= T`` here), ``G = H/128``.

Inputs are random, seeded per (seed, rank, set), generated on the device directly (``torch.randn``
with a device generator: a 4096x7168 batch never goes through the host) and never zero. Several
sets rotate between iterations. Every function that issues collectives issues them in the same
order on every rank; comparisons run only after all collectives of a check are done, so a failing
rank never leaves its peers waiting.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import layout, quant
from ..testing.compare import assert_bitwise, assert_fp8_within_one_step, assert_within_budget
from . import a2a, accounting
from .cases import BenchCase
from .oracle import HTExpect, LLExpect, canonical_ll
from .timing import TimedOp, fail_text


def _seed(base: int, rank: int, s: int, salt: int) -> int:
    return (base * 1_000_003 + rank * 7919 + s * 104_729 + salt) & 0x7FFF_FFFF


def _generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def make_routing(case: BenchCase, rank: int, s: int, device: torch.device, seed: int = 0):
    """``(topk_idx int64[T, K], topk_weights f32[T, K])``: distinct experts per token (top-K of
    random scores), a ``drop_prob`` share of slots set to ``-1`` with weight 0."""
    t, k, e = case.tokens, case.topk, case.experts
    g = _generator(device, _seed(seed, rank, s, 1))
    idx = torch.rand(t, e, generator=g, device=device).topk(k, dim=1).indices
    if case.drop_prob > 0:
        idx = idx.masked_fill(torch.rand(t, k, generator=g, device=device) < case.drop_prob, -1)
    w = (torch.rand(t, k, generator=g, device=device) + 0.1).masked_fill(idx < 0, 0.0)
    return idx.to(torch.int64), w.to(torch.float32)


def make_x(case: BenchCase, rank: int, s: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """``bf16[T, H]`` standard normal values (never all zero)."""
    g = _generator(device, _seed(seed, rank, s, 2))
    return torch.randn(case.tokens, case.hidden, generator=g, device=device, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- high-throughput


@dataclasses.dataclass
class HTSet:
    x: torch.Tensor                        # bf16[T, H]
    x_fp8: tuple[torch.Tensor, torch.Tensor]  # (fp8[T, H], f32[T, G])
    topk_idx: torch.Tensor                 # int64[T, K]
    topk_weights: torch.Tensor             # f32[T, K]
    num_tokens_per_rank: torch.Tensor      # int32[R]
    num_tokens_per_expert: torch.Tensor    # int32[E]
    is_token_in_rank: torch.Tensor         # bool[T, R]

    def layout_kwargs(self) -> dict:
        return {"num_tokens_per_rank": self.num_tokens_per_rank, "is_token_in_rank": self.is_token_in_rank,
                "num_tokens_per_expert": self.num_tokens_per_expert, "topk_idx": self.topk_idx,
                "topk_weights": self.topk_weights}


def make_ht_sets(case: BenchCase, rank: int, num_ranks: int, device: torch.device, num_sets: int,
                 seed: int = 0) -> list[HTSet]:
    out = []
    for s in range(num_sets):
        x = make_x(case, rank, s, device, seed)
        idx, w = make_routing(case, rank, s, device, seed)
        per_rank, per_expert, in_rank = layout.dispatch_layout(idx, case.experts, num_ranks)
        out.append(HTSet(x, quant.per_token_cast_to_fp8(x), idx, w, per_rank, per_expert, in_rank))
    return out


def ht_ops(buf, sets: list[HTSet], cached: bool = False, expect: HTExpect | None = None,
           layout_rows: bool = False) -> list[TimedOp]:
    """Dispatch BF16, dispatch FP8, combine BF16 on ``buf`` (an ``epcomm.Buffer``).

    ``cached``: time dispatch with a handle (no layout exchange), as DeepEP's tuning loop does.
    ``expect``: the reference's results on the checked set; each op is then verified as it was timed.
    ``layout_rows``: also ``<dtype>-worst-layout``, a ``num_worst_tokens`` dispatch whose step also runs
    ``get_dispatch_layout`` (what an ``ElasticBuffer`` dispatch does inside: the V1 row to set beside V2's).
    """
    r_ = buf.group_size
    dcfg, ccfg = buf.get_dispatch_config(r_), buf.get_combine_config(r_)

    def dispatch(fp8: bool):
        def build(s: int):
            st = sets[s]
            x = st.x_fp8 if fp8 else st.x
            if cached:
                handle = buf.dispatch(st.x, config=dcfg, **st.layout_kwargs())[4]

                def step():
                    return buf.dispatch(x, handle=handle, config=dcfg)
            else:
                def step():
                    return buf.dispatch(x, config=dcfg, **st.layout_kwargs())
            return [], [step]
        return build

    def combine(s: int):
        st = sets[s]
        recv_x, _, _, _, handle, _ = buf.dispatch(st.x, config=dcfg, **st.layout_kwargs())

        def step():
            return buf.combine(recv_x, handle, config=ccfg)
        return [], [step]

    def verify_dispatch(fp8: bool):
        if expect is None:
            return None
        return lambda s, out: expect.dispatch(s, out, fp8, f"timed dispatch ({'fp8' if fp8 else 'bf16'}, set {s})")

    verify_combine = None if expect is None else (lambda s, out: expect.combine(s, out, f"timed combine (set {s})"))
    ops = [TimedOp("dispatch", "bf16", ("total",), dispatch(False), verify=verify_dispatch(False)),
           TimedOp("dispatch", "fp8", ("total",), dispatch(True), verify=verify_dispatch(True)),
           TimedOp("combine", "bf16", ("total",), combine, capturable=buf.backend_name != "reference",
                   verify=verify_combine)]
    if buf.backend_name != "reference" and not cached:
        # GPU time without the host: num_worst_tokens (no host sync) lets the dispatch be captured in
        # a CUDA graph; rows are labelled "<dtype>-worst" (outputs padded to R*T rows).
        worst = r_ * sets[0].x.shape[0]

        def dispatch_worst(fp8: bool, with_layout: bool = False):
            def build(s: int):
                st = sets[s]
                x = st.x_fp8 if fp8 else st.x
                e = st.num_tokens_per_expert.shape[0]

                def step():
                    return buf.dispatch(x, config=dcfg, num_worst_tokens=worst, **st.layout_kwargs())

                def step_layout():  # the layout computed in the call, as an ElasticBuffer dispatch computes it
                    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(st.topk_idx, e)
                    return buf.dispatch(x, config=dcfg, num_worst_tokens=worst, num_tokens_per_rank=per_rank,
                                        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                        topk_idx=st.topk_idx, topk_weights=st.topk_weights)
                return [], [step_layout if with_layout else step]
            return build

        ops += [TimedOp("dispatch", "bf16-worst", ("total",), dispatch_worst(False), capturable=True,
                        verify=verify_dispatch(False)),
                TimedOp("dispatch", "fp8-worst", ("total",), dispatch_worst(True), capturable=True,
                        verify=verify_dispatch(True))]
        if layout_rows:
            ops += [TimedOp("dispatch", f"{d}-worst-layout", ("total",), dispatch_worst(d == "fp8", True),
                            capturable=True, verify=verify_dispatch(d == "fp8")) for d in ("bf16", "fp8")]
    return ops


def gather_matrix(group, vec: torch.Tensor) -> torch.Tensor:
    """All-gather one ``int[R]`` vector per rank → ``int64[R, R]`` on the host (row = source rank)."""
    parts = [torch.empty_like(vec) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, vec.contiguous(), group=group)
    return torch.stack(parts).to(torch.int64).cpu()


def gather_routings(group, sets, case: BenchCase, num_ranks: int) -> list[accounting.Routing]:
    """Every rank's routing of each input set (:class:`accounting.Routing`), for the byte counts."""
    return [accounting.Routing.from_rows(gather_matrix(group, accounting.local_routing(st.topk_idx, case.experts,
                                                                                        num_ranks)))
            for st in sets]


def check_ht(bufs: dict, st: HTSet, set_index: int = 0) -> tuple[dict[str, str], HTExpect]:
    """Check each backend once on set ``st``: ``"pass"`` or ``"FAIL: ..."`` per backend name, and the
    reference's results on ``st`` (what :func:`ht_ops` verifies the timed runs against).

    - every backend: the FP8 rows received are the FP8 cast of the BF16 rows received (bitwise),
      and combine(dispatch(x)) = x * (ranks the token went to), within the BF16 reduction budget;
    - backends other than ``reference``: dispatch outputs bitwise equal to the reference's.
    """
    outs = {}
    for name, buf in bufs.items():  # collectives first, in the same order everywhere
        d = buf.dispatch(st.x, **st.layout_kwargs())
        f = buf.dispatch(st.x_fp8, **st.layout_kwargs())
        c = buf.combine(d[0], d[4])[0]
        outs[name] = (d, f, c)
    ref_d, ref_f, _ = outs["reference"]
    cnt = st.is_token_in_rank.sum(1).to(torch.float64).unsqueeze(1).cpu()
    x64 = st.x.double().cpu()
    num_ranks = st.is_token_in_rank.shape[1]
    result = {}
    for name, (d, f, c) in outs.items():
        try:
            if name != "reference":
                assert_bitwise(d[0], ref_d[0], "dispatch bf16 recv_x")
                assert_bitwise(d[1], ref_d[1], "dispatch recv_topk_idx")
                assert_bitwise(d[2], ref_d[2], "dispatch recv_topk_weights")
                if list(d[3]) != list(ref_d[3]):
                    raise AssertionError(f"num_recv_tokens_per_expert_list {list(d[3])} != {list(ref_d[3])}")
                assert_bitwise(f[0][0], ref_f[0][0], "dispatch fp8 recv_x")
                assert_bitwise(f[0][1], ref_f[0][1], "dispatch fp8 recv scales")
            q, sc = quant.per_token_cast_to_fp8(d[0])
            assert_bitwise(f[0][0], q, "fp8 rows vs the cast of the bf16 rows")
            assert_bitwise(f[0][1], sc, "fp8 scales vs the cast of the bf16 rows")
            assert_within_budget(c, x64 * cnt, x64.abs() * cnt, num_ranks, "combine(dispatch(x)) vs x*ranks")
            result[name] = "pass"
        except AssertionError as e:
            result[name] = fail_text(e)
    return result, HTExpect(ref_d[0], ref_f[0], x64 * cnt, x64.abs() * cnt, num_ranks, set_index)


# ----------------------------------------------------------------------------- low-latency


@dataclasses.dataclass
class LLSet:
    x: torch.Tensor             # bf16[T, H]
    topk_idx: torch.Tensor      # int64[T, K]
    topk_weights: torch.Tensor  # f32[T, K]
    y: torch.Tensor             # bf16[L, R*M, H]: the "expert outputs" combine sends back


def make_ll_sets(case: BenchCase, rank: int, num_ranks: int, device: torch.device, num_sets: int,
                 seed: int = 0) -> list[LLSet]:
    lx, m = case.experts // num_ranks, case.tokens
    out = []
    for s in range(num_sets):
        idx, w = make_routing(case, rank, s, device, seed)
        g = _generator(device, _seed(seed, rank, s, 3))
        y = torch.randn(lx, num_ranks * m, case.hidden, generator=g, device=device, dtype=torch.bfloat16)
        out.append(LLSet(make_x(case, rank, s, device, seed), idx, w, y))
    return out


def ll_ops(buf, sets: list[LLSet], case: BenchCase, expect: LLExpect | None = None) -> list[TimedOp]:
    """Low-latency FP8 dispatch and BF16 combine (each combine after an untimed dispatch, so its
    handle is always one of the two live results); with ``case.hook`` also their send/recv halves.
    ``expect``: the reference's results on the checked set (:func:`ll_expect`); each op is then
    verified as it was timed."""
    m, e = case.tokens, case.experts
    capturable = buf.backend_name != "reference"  # the reference synchronises with the host

    def dispatch(s: int, hook: bool = False, state: dict | None = None):
        st = sets[s]
        out = buf.low_latency_dispatch(st.x, st.topk_idx, m, e, use_fp8=True, return_recv_hook=hook)
        if state is not None:
            state["handle"], state["hook"], state["out"] = out[2], out[4], out
        return out

    def received(state: dict):
        """The hook step: receive, then return what the call produced (valid from now on)."""
        state["hook"]()
        return state["out"]

    def build_dispatch(s: int):
        return [], [lambda: dispatch(s)]

    def build_dispatch_hook(s: int):
        state: dict = {}
        return [], [lambda: dispatch(s, True, state), lambda: received(state)]

    def build_combine(s: int, hook: bool = False):
        st, state = sets[s], {}

        def send():
            out = buf.low_latency_combine(st.y, st.topk_idx, st.topk_weights, state["handle"],
                                          return_recv_hook=hook)
            # what the combine returns, with the handle it combined through (the check needs its slots)
            state["hook"], state["out"] = out[2], (out[0], state["handle"])
            return state["out"]

        steps = [send, lambda: received(state)] if hook else [send]
        return [lambda: dispatch(s, False, state)], steps

    verify_d = verify_c = None
    if expect is not None:
        def verify_d(s, out):
            expect.dispatch(s, out, f"timed low-latency dispatch (set {s})")

        def verify_c(s, out):
            expect.combine(s, out, f"timed low-latency combine (set {s})")
    ops = [TimedOp("dispatch", "fp8", ("total",), build_dispatch, capturable, verify=verify_d),
           TimedOp("combine", "bf16", ("total",), build_combine, capturable, verify=verify_c)]
    if case.hook:
        ops += [TimedOp("dispatch", "fp8", ("send", "recv"), build_dispatch_hook, capturable, verify=verify_d),
                TimedOp("combine", "bf16", ("send", "recv"), lambda s: build_combine(s, True), capturable,
                        verify=verify_c)]
    return ops


def check_ll(bufs: dict, st: LLSet, case: BenchCase) -> dict[str, str]:
    """Check each backend once: ``"pass"`` or ``"FAIL: ..."`` per backend name.

    - backends other than ``reference``: the valid dispatched FP8 rows (data, scales, source
      indices, counts) bitwise equal to the reference's, up to the order within a source block;
    - every backend: combining the dequantised received rows gives, for each token,
      ``dequant(fp8(x[t])) * sum_k w[t, k]`` within the BF16 budget of a 2K-term float32 sum
      (K products and K additions).
    """
    m, e, k = case.tokens, case.experts, case.topk
    got = {}
    for name, buf in bufs.items():  # collectives first, in the same order everywhere
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(st.x, st.topk_idx, m, e, use_fp8=True)
        canon = canonical_ll(recv_x, recv_count, handle)
        valid = canon.pop("valid")
        y = torch.zeros_like(st.y)
        y[valid] = quant.per_token_cast_back(recv_x[0].view(torch.uint8)[valid].view(torch.float8_e4m3fn),
                                             recv_x[1][valid])
        out = buf.low_latency_combine(y, st.topk_idx, st.topk_weights, handle)[0]
        got[name] = (canon, out.clone())
    xh = quant.per_token_cast_back(*quant.per_token_cast_to_fp8(st.x)).double().cpu()
    w = (st.topk_weights * (st.topk_idx >= 0)).double().cpu()
    ref64, terms = xh * w.sum(1, keepdim=True), xh.abs() * w.abs().sum(1, keepdim=True)
    ref_canon = got["reference"][0]
    result = {}
    for name, (canon, out) in got.items():
        try:
            if name != "reference":
                for field in ("recv_count", "block_count", "key", "scales"):
                    assert_bitwise(canon[field], ref_canon[field], f"low-latency dispatch {field}")
                # FP8 data within the FP8 budget: at most one e4m3 rounding step from the reference cast
                assert_fp8_within_one_step(canon["q"], ref_canon["q"], "low-latency dispatch q")
            assert_within_budget(out, ref64, terms, 2 * k, "low-latency combine vs dequant(x)*sum(w)")
            result[name] = "pass"
        except AssertionError as e:
            result[name] = fail_text(e)
    return result


# ----------------------------------------------------------------------------- peer baseline


def a2a_ops(group, sets, case: BenchCase) -> list[TimedOp]:
    """The peer baseline (:mod:`epcomm.bench.a2a`) on the same inputs: for a high-throughput case
    dispatch BF16, dispatch FP8 and combine BF16; for a low-latency case dispatch FP8 (the cast
    included, as the low-latency dispatch does it) and combine BF16. Each is verified as timed by a
    round trip: the rows dispatch delivered (FP8 ones dequantised to BF16), combined back, give
    ``x * Σ_k w`` (within the BF16 budget of a 2K-term float32 sum; every rank runs the check's
    collectives in the same order)."""
    e, t = case.experts, case.tokens

    def dispatch(fp8: bool, cast: bool = False):
        def build(s: int):
            st = sets[s]
            if cast:
                def step():
                    return a2a.dispatch(quant.per_token_cast_to_fp8(st.x), st.topk_idx, st.topk_weights, e, group)
            else:
                x = st.x_fp8 if fp8 else st.x

                def step():
                    return a2a.dispatch(x, st.topk_idx, st.topk_weights, e, group)
            return [], [step]
        return build

    def combine(s: int):
        st, state = sets[s], {}

        def prep():
            state["rows"], _, state["st"] = a2a.dispatch(st.x, st.topk_idx, st.topk_weights, e, group)

        return [prep], [lambda: a2a.combine(state["rows"], state["st"], t, group)]

    def verify_combine(s: int, out, fp8: bool = False) -> None:
        st = sets[s]
        w = (st.topk_weights * (st.topk_idx >= 0)).double().cpu()
        x = quant.per_token_cast_back(*quant.per_token_cast_to_fp8(st.x)).to(torch.bfloat16) if fp8 else st.x
        x64 = x.double().cpu()
        assert_within_budget(out, x64 * w.sum(1, keepdim=True), x64.abs() * w.abs().sum(1, keepdim=True),
                             2 * case.topk, f"a2a combine(dispatch(x{' fp8' if fp8 else ''})) vs x * sum(w)")

    def verify_dispatch(fp8: bool):
        def verify(s: int, out) -> None:
            recv, _, state = out
            rows = quant.per_token_cast_back(*recv).to(torch.bfloat16) if fp8 else recv
            verify_combine(s, a2a.combine(rows, state, t, group), fp8)
        return verify

    trip = {"oracle": "round trip"}  # its rows come in expert order: no reference result to compare bitwise
    if case.mode == "ht":
        return [TimedOp("dispatch", "bf16", ("total",), dispatch(False), verify=verify_dispatch(False), **trip),
                TimedOp("dispatch", "fp8", ("total",), dispatch(True), verify=verify_dispatch(True), **trip),
                TimedOp("combine", "bf16", ("total",), combine, verify=verify_combine, **trip)]
    return [TimedOp("dispatch", "fp8", ("total",), dispatch(True, cast=True), verify=verify_dispatch(True), **trip),
            TimedOp("combine", "bf16", ("total",), combine, verify=verify_combine, **trip)]
