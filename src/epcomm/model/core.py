"""The cost model itself: links, workloads, routing statistics, and ``predict`` (the time of one call
from byte counts, link rates and latencies, at any EP size). ``model.check`` holds the published and
measured rows it is checked against, ``model.report`` its tables, files and plot.

Letters: ``T`` tokens per rank, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks (the EP size),
``G`` GPUs per node, ``N = R / G`` nodes, ``L = E / R`` experts per rank.

The paths modelled (every rank alike: it sends and receives the average of the routing statistics):

- **High-throughput (HT), hierarchical.** A token crosses the network at most once per destination
  node, to the GPU with its own local index there, which forwards it over NVLink to the other GPUs of
  that node holding its experts; tokens for the own node take NVLink directly. Combine runs the same
  paths backwards (reduced in the node first, one partial sum per token and node on the network). The
  two legs are pipelined in chunks: ``time = max(network leg, NVLink leg) + fixed``. On one node
  (``R <= G``) only the NVLink leg exists.
- **Low-latency (LL), direct.** Each (token, expert) selection is one message straight to the
  destination rank (``messages="rank"``: one per (token, rank), epcomm's nvlink layout); same-node
  peers over NVLink when ``nvlink_ll``, else through the NIC too. ``time = launches + max(network,
  NVLink) + one-way latency + the local copy (dispatch) or reduction (combine) at HBM speed``.

A leg's time is ``bytes / (peak GB/s * efficiency)``. The two efficiencies are the model's only
calibrated constants (``model.check.calibrate``): the NVLink one from DeepEP's intranode EP8 dispatch row, the
network one from its internode EP64 dispatch row; every other row checks the model (docs/model.md).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

DTYPES = ("bf16", "fp8")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Links:
    """Per-GPU link figures (GB/s per direction, µs). Defaults: DeepEP's H800 + CX7 test machine."""

    nvlink_gbps: float = 160.0        # DeepEP README: H800 "~160 GB/s NVLink maximum bandwidth"
    nic_gbps: float = 50.0            # 400 Gb/s CX7 per GPU ("~50 GB/s maximum bandwidth")
    gpus_per_node: int = 8
    nvlink_efficiency: float = 0.843  # calibrated: calibrate()["nvlink_efficiency"]
    nic_efficiency: float = 0.895     # calibrated: calibrate()["nic_efficiency"]
    nvlink_latency_us: float = 1.2    # one way: half the 2.4 µs flag round trip measured on 2xH200
    nic_latency_us: float = 3.0       # one way GPU-initiated RDMA write and its signal, one switch: assumed
    launch_us: float = 3.0            # per kernel in a CUDA graph (2-3 µs profiled on nvidia-h200-x2)
    hbm_gbps: float = 2760.0          # local copy, read + write counted (an H200 copy, measured)
    qps_per_peer: int = 24            # queue pairs per peer (Buffer's num_qps_per_rank)
    nic_ports: int = 1                # ports per NIC; QPs sit on ports round-robin

    def __post_init__(self) -> None:
        for f in ("nvlink_gbps", "nic_gbps", "hbm_gbps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f} must be > 0 GB/s, got {getattr(self, f)!r}")
        for f in ("nvlink_efficiency", "nic_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"{f} must be in (0, 1], got {getattr(self, f)!r}")
        for f in ("nvlink_latency_us", "nic_latency_us", "launch_us"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"{f} must be >= 0 µs, got {getattr(self, f)!r}")
        for f in ("gpus_per_node", "qps_per_peer", "nic_ports"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be an integer >= 1, got {v!r}")

    def port_factor(self) -> float:
        """How much slower the NIC runs than its total rate because QPs share ports unevenly: each peer's
        traffic is spread evenly over its ``qps_per_peer`` QPs, QP ``i`` sits on port ``i % nic_ports``
        (the same for every peer), so the busiest port carries ``ceil(q / P) / q`` of it.
        Example: 1 QP on a dual-port NIC -> 2.0 (one port idle); 24 QPs -> 1.0; 3 QPs -> 4/3."""
        q, p = self.qps_per_peer, self.nic_ports
        return math.ceil(q / p) * p / q


PRESETS = {
    "h800-cx7": Links(),
    # 2xH200 on one host (nvidia-h200-x2): the copy-engine ceiling measured there (ce_gbps 385.7 in
    # benchmarks/2026-11-22/h200x2-0653-ht-dsv3.jsonl) as NVLink's achievable peak; no RDMA NIC, so the
    # network figures are never used at R <= 2
    "h200-x2": Links(nvlink_gbps=386.0, gpus_per_node=2),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """The call being modelled (per rank). ``dtype`` is the dispatch's payload; combine is always BF16."""

    tokens: int
    hidden: int = 7168
    topk: int = 8
    experts: int = 256
    dtype: str = "fp8"
    cached: bool = True       # HT dispatch with a handle (no count exchange), as DeepEP tunes it
    messages: str = "expert"  # LL: one message per (token, expert) (DeepEP) or per (token, rank) (epcomm)
    nvlink_ll: bool = True    # LL: same-node peers over NVLink (allow_nvlink_for_low_latency_mode)
    ll_kernels: int = 1       # launches per LL call (DeepEP: one send+receive kernel; epcomm: 2)
    ht_kernels: int = 2       # launches per HT call (a preparation kernel and the transfer)

    def __post_init__(self) -> None:
        for f in ("tokens", "hidden", "topk", "experts", "ll_kernels", "ht_kernels"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be an integer >= 1, got {v!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.dtype == "fp8" and self.hidden % 128:
            raise ValueError(f"hidden must be a multiple of 128 for fp8, got {self.hidden}")
        if self.messages not in ("expert", "rank"):
            raise ValueError(f"messages must be 'expert' or 'rank', got {self.messages!r}")
        if self.topk > self.experts:
            raise ValueError(f"topk must be <= experts={self.experts}, got {self.topk}")

    def token_bytes(self, dtype: str) -> int:
        """HT row: BF16 ``2H``; FP8 ``H`` plus one float32 scale per 128 channels."""
        return 2 * self.hidden if dtype == "bf16" else self.hidden + self.hidden // 128 * 4

    def message_bytes(self, dtype: str) -> int:
        """LL message: the row and a 16-byte header (combine messages carry the BF16 row alone)."""
        return self.token_bytes(dtype) + 16


@dataclasses.dataclass(frozen=True)
class RoutingStats:
    """Per-token averages for one source rank (``R`` ranks, ``G`` per node), from which every byte count
    follows. ``nvl_forwards``: rows an HT forwarder sends over NVLink for one source token (the ranks it
    reaches in touched nodes, less the forwarders themselves)."""

    ranks: int
    gpus_per_node: int
    ranks_touched: float      # distinct destination ranks, self included
    self_touched: float       # probability that the source rank holds one of the token's experts
    nodes_touched: float      # distinct destination nodes, own node included
    own_node_touched: float
    nvl_forwards: float
    selections: float         # valid (token, expert) pairs: K less the -1 entries
    sel_self: float           # of which on the source rank, ...
    sel_node: float           # ... on other ranks of its node, ...
    sel_remote: float         # ... on other nodes
    ranks_node: float         # distinct touched ranks on the own node, self excluded
    ranks_remote: float       # distinct touched ranks on other nodes
    source: str               # how the statistics were obtained


def _nodes(ranks: int, gpus_per_node: int) -> tuple[int, int]:
    g = min(gpus_per_node, ranks)
    if ranks % g:
        raise ValueError(f"ranks={ranks} must be a multiple of gpus_per_node={g}")
    return g, ranks // g


def uniform_stats(ranks: int, gpus_per_node: int, experts: int, topk: int) -> RoutingStats:
    """Each token picks ``K`` distinct experts uniformly at random (what top-k of i.i.d. scores gives),
    computed exactly: ``P(a given rank is missed) = C(E-L, K) / C(E, K)``, and so on per node.

    Example: ``R = 2, G = 2, E = 4, K = 2``: a rank is missed with probability ``C(2,2)/C(4,2) = 1/6``,
    so ``ranks_touched = 2 * 5/6``, and ``sel_node = 1`` (half of the two selections)."""
    if ranks < 1 or experts % ranks:
        raise ValueError(f"experts={experts} must be a multiple of ranks={ranks}")
    g, n = _nodes(ranks, gpus_per_node)
    e_rank, e_node = experts // ranks, experts // n
    total = math.comb(experts, topk)
    hit_rank = 1 - math.comb(experts - e_rank, topk) / total
    hit_node = 1 - math.comb(experts - e_node, topk) / total
    return RoutingStats(
        ranks=ranks, gpus_per_node=g, ranks_touched=ranks * hit_rank, self_touched=hit_rank,
        nodes_touched=n * hit_node, own_node_touched=hit_node, nvl_forwards=(ranks - n) * hit_rank,
        selections=topk, sel_self=topk / ranks, sel_node=topk * (g - 1) / ranks,
        sel_remote=topk * (ranks - g) / ranks, ranks_node=(g - 1) * hit_rank, ranks_remote=(ranks - g) * hit_rank,
        source="uniform (exact)")


def stats_from_ids(topk_idx, ranks: int, gpus_per_node: int, experts: int, source_rank: int = 0,
                   source: str = "routing ids") -> RoutingStats:
    """Statistics of measured routing: ``topk_idx int64[T, K]`` (global expert ids, ``-1`` = none) as sent
    by ``source_rank``, or ``int64[R, T, K]`` with every rank's ids (averaged over the sources)."""
    import torch

    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"topk_idx must be an int64 (or int32) tensor, got {getattr(topk_idx, 'dtype', type(topk_idx))}")
    if topk_idx.dim() == 2:
        if not 0 <= source_rank < ranks:
            raise ValueError(f"source_rank must be in [0, {ranks}), got {source_rank}")
        ids, sources = topk_idx.long().unsqueeze(0), torch.tensor([source_rank])
    elif topk_idx.dim() == 3 and topk_idx.shape[0] == ranks:
        ids, sources = topk_idx.long(), torch.arange(ranks)
    else:
        raise ValueError(f"topk_idx must be [T, K] or [R={ranks}, T, K], got shape {tuple(topk_idx.shape)}")
    if experts % ranks:
        raise ValueError(f"experts={experts} must be a multiple of ranks={ranks}")
    if ids.numel() and (ids.min() < -1 or ids.max() >= experts):
        raise ValueError(f"topk_idx holds ids outside [-1, {experts}): {ids.min().item()}..{ids.max().item()}")
    g, n = _nodes(ranks, gpus_per_node)
    s, t, _ = ids.shape
    valid = ids >= 0
    rank = torch.where(valid, ids // (experts // ranks), torch.full_like(ids, ranks))  # ranks = "none"
    src = sources.view(s, 1, 1)
    touched = torch.zeros(s, t, ranks + 1, dtype=torch.bool).scatter_(2, rank, True)[..., :ranks]
    node_touched = touched.view(s, t, n, g).any(-1)
    own = (sources // g).view(s, 1, 1)
    same_node = (torch.arange(ranks).view(1, 1, -1) // g) == own
    is_self = torch.arange(ranks).view(1, 1, -1) == src
    forwarders = torch.arange(n).view(1, -1) * g + (sources % g).view(s, 1)  # [s, n]
    per_tok = s * t

    def mean(x) -> float:
        return float(x.sum()) / per_tok if per_tok else 0.0

    sel_node_mask = valid & (rank // g == own) & (rank != src)
    return RoutingStats(
        ranks=ranks, gpus_per_node=g, ranks_touched=mean(touched), self_touched=mean(touched & is_self),
        nodes_touched=mean(node_touched), own_node_touched=mean(node_touched.gather(2, own.expand(s, t, 1))),
        nvl_forwards=mean(touched) - mean(touched.gather(2, forwarders.unsqueeze(1).expand(s, t, n))),
        selections=mean(valid), sel_self=mean(valid & (rank == src)), sel_node=mean(sel_node_mask),
        sel_remote=mean(valid & (rank // g != own)), ranks_node=mean(touched & same_node & ~is_self),
        ranks_remote=mean(touched & ~same_node), source=source)


def node_limited_ids(tokens: int, ranks: int, gpus_per_node: int, experts: int, topk: int, topk_groups: int = 4,
                     seed: int = 0):
    """Group-limited routing as DeepSeek-V3 trains and DeepEP's internode test draws it: scores ``|N(0,1)| + 1``,
    a node's score is its best expert's, each token keeps its ``min(topk_groups, N)`` best nodes and takes its
    top ``K`` experts among theirs. Returns ``int64[T, K]`` (seeded, CPU)."""
    import torch

    _, n = _nodes(ranks, gpus_per_node)
    if experts % n:
        raise ValueError(f"experts={experts} must be a multiple of the node count {n}")
    m = min(topk_groups, n)
    if topk_groups < 1 or topk > m * (experts // n):
        raise ValueError(f"topk_groups={topk_groups} nodes of {experts // n} experts cannot hold topk={topk}")
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, experts, generator=gen).abs() + 1
    groups = scores.view(tokens, n, -1).amax(-1).topk(m, dim=-1).indices
    keep = torch.zeros(tokens, n, dtype=torch.bool).scatter_(1, groups, True)
    masked = scores.masked_fill(~keep.repeat_interleave(experts // n, dim=1), float("-inf"))
    return masked.topk(topk, dim=-1).indices


@dataclasses.dataclass(frozen=True)
class Prediction:
    mode: str                 # "ht" | "ll"
    op: str                   # "dispatch" | "combine"
    dtype: str
    ranks: int
    nodes: int
    time_us: float
    nic_us: float             # the network leg alone
    nvlink_us: float          # the NVLink leg alone
    local_us: float           # the local copy or reduction (LL)
    fixed_us: float           # launches and latencies
    bottleneck: str
    nic_bytes: float          # per rank, one direction
    nvlink_bytes: float
    deepep_bytes: float       # the bytes DeepEP's tests divide by the time (docs/model.md)

    @property
    def deepep_gbps(self) -> float:
        return self.deepep_bytes / self.time_us / 1e3


def _leg_us(nbytes: float, gbps: float, eff: float) -> float:
    return nbytes / (gbps * eff) / 1e3


def predict(links: Links, work: Workload, stats: RoutingStats, mode: str, op: str) -> Prediction:
    """One call's predicted time on ``stats.ranks`` ranks. ``mode`` "ht" or "ll", ``op`` "dispatch" or "combine"."""
    if mode not in ("ht", "ll") or op not in ("dispatch", "combine"):
        raise ValueError(f"mode must be 'ht' or 'll' and op 'dispatch' or 'combine', got {mode!r}, {op!r}")
    if stats.gpus_per_node != min(links.gpus_per_node, stats.ranks):
        raise ValueError(f"routing statistics are for {stats.gpus_per_node} GPUs per node, links say "
                         f"{links.gpus_per_node}")
    r_, g = stats.ranks, stats.gpus_per_node
    n = r_ // g
    dtype = work.dtype if op == "dispatch" else "bf16"
    t = work.tokens
    if mode == "ht":
        row = work.token_bytes(dtype)
        if n == 1:  # one node: straight to every touched rank over NVLink
            nic_b, nvl_b = 0.0, t * (stats.ranks_touched - stats.self_touched) * row
            deepep = t * stats.ranks_touched * row  # DeepEP intranode: every received row, own ones included
        else:
            nic_b = t * (stats.nodes_touched - stats.own_node_touched) * row
            nvl_b = t * stats.nvl_forwards * row
            deepep = t * stats.nodes_touched * row  # DeepEP internode: rows per node, own node included
        lat = links.nvlink_latency_us + (links.nic_latency_us if n > 1 else 0.0)
        fixed = work.ht_kernels * links.launch_us + lat
        if op == "dispatch" and not work.cached:  # the count exchange: one more launch and a round trip
            fixed += links.launch_us + 2 * (links.nic_latency_us if n > 1 else links.nvlink_latency_us)
        local = 0.0
    else:
        msg = work.message_bytes(dtype) if op == "dispatch" else work.token_bytes("bf16")
        if work.messages == "expert":
            node, remote, total = stats.sel_node, stats.sel_remote, stats.selections
        else:
            node, remote, total = stats.ranks_node, stats.ranks_remote, stats.ranks_touched
        if work.nvlink_ll:
            nic_b, nvl_b = t * remote * msg, t * node * msg
        else:
            nic_b, nvl_b = t * (remote + node) * msg, 0.0
        deepep = t * stats.selections * msg
        lat = links.nic_latency_us if nic_b else links.nvlink_latency_us
        fixed = work.ll_kernels * links.launch_us + lat
        # dispatch: the receiver reads what arrived and writes one row per expert; combine: every
        # selection's row is read once and each token's sum written (the HBM figure counts both ways)
        if op == "dispatch":
            moved = t * (total + stats.selections) * msg
        else:
            moved = t * (stats.selections + 1) * msg
        local = _leg_us(moved, links.hbm_gbps, 1.0)
    nic = _leg_us(nic_b * links.port_factor(), links.nic_gbps, links.nic_efficiency) if nic_b else 0.0
    nvl = _leg_us(nvl_b, links.nvlink_gbps, links.nvlink_efficiency) if nvl_b else 0.0
    legs = {"network": nic, "NVLink": nvl, "local": local, "fixed": fixed}
    return Prediction(mode, op, dtype, r_, n, max(nic, nvl) + local + fixed, nic, nvl, local, fixed,
                      max(legs, key=legs.get), nic_b, nvl_b, deepep)


def routing_stats(kind: str, ranks: int, links: Links, work: Workload, *, topk_groups: int = 4, samples: int = 8192,
                  seed: int = 0, source_rank: int = 0) -> RoutingStats:
    """``kind``: "uniform" (exact), "node-limited" (``samples`` seeded tokens, ``node_limited_ids``), or the path
    of a ``torch.save``d ``int64[T, K]`` / ``[R, T, K]`` tensor of expert ids."""
    g = min(links.gpus_per_node, ranks)
    if kind == "uniform":
        return uniform_stats(ranks, g, work.experts, work.topk)
    if kind == "node-limited":
        ids = node_limited_ids(samples, ranks, g, work.experts, work.topk, topk_groups, seed)
        return stats_from_ids(ids, ranks, g, work.experts, source=f"node-limited top-{min(topk_groups, ranks // g)} "
                              f"nodes, {samples} sampled tokens, seed {seed}")
    path = Path(kind)
    if not path.is_file():
        raise ValueError(f"routing must be 'uniform', 'node-limited' or a file of expert ids, got {kind!r}")
    import torch

    try:
        ids = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's input error
        raise ValueError(f"routing file {str(path)!r} is not a saved tensor of expert ids: {e}") from None
    return stats_from_ids(ids, ranks, g, work.experts, source_rank, source=f"file {path.name}")


def sweep(links: Links, ht: Workload | None, ll: Workload | None, eps: list[int], routing: str = "node-limited",
          **routing_kw) -> list[dict]:
    """Rows (dicts) of predicted HT and LL dispatch and combine at every EP size in ``eps``."""
    rows = []
    for mode, work in (("ht", ht), ("ll", ll)):
        for r_ in eps:
            if work is None:
                continue
            if work.experts % r_:
                raise ValueError(f"experts={work.experts} must be a multiple of every EP size, got {r_}")
            stats = routing_stats(routing, r_, links, work, **routing_kw)
            for op in ("dispatch", "combine"):
                p = predict(links, work, stats, mode, op)
                rows.append({**dataclasses.asdict(p), "deepep_gbps": p.deepep_gbps, "tokens": work.tokens,
                             "hidden": work.hidden, "topk": work.topk, "experts": work.experts,
                             "routing": stats.source})
    return rows
