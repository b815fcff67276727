"""The internode backend (issue 16): nodes, NVSHMEM start-up, whether the backend can run, and the
backend itself.

What it serves:
- **low-latency** dispatch and combine over NVSHMEM (``backends/internode_ll.py``, kernels in
  ``kernels/internode_ll.py`` and ``kernels/ll.py``'s receive side): per-expert messages straight to the
  destination rank, NVSHMEM puts (staged in this rank's symmetric buffer) to ranks on other nodes,
  plain stores to ranks of this node when ``allow_nvlink_for_low_latency_mode`` (else NVSHMEM too);
- **high-throughput** dispatch, cached dispatch and combine, hierarchical (``backends/internode_ht.py``,
  ``kernels/internode_ht.py``, ``internode_ht_combine.py``): a token crosses the network at most once
  per destination node, to the rank with the sender's local index there, which forwards it over NVLink;
  combine reduces in the node first. Its layout exchange is a kernel of NVSHMEM puts (then one host
  synchronisation, none with ``num_worst_tokens``: those calls are CUDA-graph capturable).

Also here: the node map (hosts, or virtual nodes of ``EPCOMM_GPUS_PER_NODE`` ranks), the NVSHMEM settings
applied before NVSHMEM initialises (``_env.nvshmem_settings``), NVSHMEM symmetric memory through torch
(:func:`nvshmem_symmetric`). docs/internode.md has the design and what is tested where.

Letters: ``R`` ranks, ``N`` GPUs per node, ``P = R / N`` nodes.

Symmetric buffer (one NVSHMEM allocation per Buffer)::

    [LL region: num_rdma_bytes in low-latency mode (else empty), laid out by layout.low_latency_buffer_layout]
    [LL signals: 2 parities x 3R uint64][M table: int32[R]][LL combine staging: num_rdma_bytes / 2]
    [HT layout exchange: 2 parities x R uint64 signals, staging R x S int32, 2 parities x R x S int32]
    [HT region: num_nvl_bytes (+ num_rdma_bytes outside low-latency mode), 64 MiB if both are 0]

``get_local_buffer_tensor`` views the buffer itself: its NVL buffer is the HT region's first
``num_nvl_bytes``; its RDMA buffer the LL region, or outside low-latency mode the HT region's next
``num_rdma_bytes`` (so each byte the user asks for is reserved once).

``S`` (:func:`notify_words`) holds one rank's layout row for another: its counts per rank, its
``num_tokens_per_rank``, its token count, its counts per node, its channel prefix and its expert counts for
that rank, and its channel prefix for that rank's node; sized for the most channels and local experts
(``C_MAX``, ``L_MAX``), under 6 MiB at 256 ranks.
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
import zlib

import torch
import torch.distributed as dist

from .. import _env
from . import deadline
from .base import Backend, checked_run, gave_up, raise_error_word

log = logging.getLogger(__name__)

SERVES = "low-latency over NVSHMEM; high-throughput hierarchical over NVSHMEM and NVLink"  # (epcomm env)

DEFAULT_HT_BYTES = 64 << 20  # the high-throughput region when the Buffer names no bytes for it
_applied: dict | None = None  # the NVSHMEM settings in force once applied in this process


def node_map(hosts: list, gpus_per_node: int | None) -> tuple[list[int], str]:
    """``(node of each rank, how the nodes were formed)`` for ranks on ``hosts`` (one entry per rank).

    Without virtual nodes a node is a host; its ranks must be consecutive (as torchrun places them).
    With ``gpus_per_node = N`` rank ``r`` is on node ``r // N``; ``N`` divides ``R`` and no node spans
    hosts. Example: hosts ``[a, a, a, a]``, ``N = 2`` -> ``[0, 0, 1, 1]``; hosts ``[a, a, b, b]``,
    ``N = None`` -> ``[0, 0, 1, 1]``.
    """
    r_ = len(hosts)
    if gpus_per_node is None:
        nodes, seen = [], {}
        for r, h in enumerate(hosts):
            if h not in seen:
                seen[h] = len(seen)
            elif nodes[-1] != seen[h]:
                raise ValueError(f"the ranks of a host must be consecutive (rank {r} is on host {seen[h]} "
                                 f"after host {nodes[-1]}); launch with torchrun's default placement")
            nodes.append(seen[h])
        counts = {n: nodes.count(n) for n in set(nodes)}
        if len(set(counts.values())) > 1:
            raise ValueError(f"every host needs the same number of ranks, got {sorted(counts.values())}")
        return nodes, f"{len(counts)} host(s) of {r_ // len(counts)} rank(s)"
    n = gpus_per_node
    if r_ % n:
        raise ValueError(f"EPCOMM_GPUS_PER_NODE={n} does not divide the group's {r_} ranks")
    nodes = [r // n for r in range(r_)]
    for node in range(r_ // n):
        if len({hosts[r] for r in range(node * n, node * n + n)}) > 1:
            raise ValueError(f"EPCOMM_GPUS_PER_NODE={n}: virtual node {node} (ranks {node * n}..{node * n + n - 1})"
                             " spans hosts")
    return nodes, f"{r_ // n} virtual node(s) of {n} rank(s) (EPCOMM_GPUS_PER_NODE={n})"


def group_nodes(group, timeout_s: float | None = None) -> tuple[list[int], str]:
    """:func:`node_map` for ``group`` (collective: every rank calls it). Every rank must set the same
    ``EPCOMM_GPUS_PER_NODE``. The ranks exchange ``[host hash, EPCOMM_GPUS_PER_NODE or 0]`` as a tensor
    (no NumPy), within ``timeout_s`` (default ``EPCOMM_TIMEOUT_S``, else 30 s on gloo, 10 s on NCCL)."""
    if timeout_s is None:
        timeout_s = _env.timeout_s(30.0 if deadline.exchange_device(group).type == "cpu" else 10.0)
    rows = deadline.all_gather_ints(group, [zlib.crc32(socket.gethostname().encode()), _env.gpus_per_node() or 0],
                                    dist.get_rank(group), "Buffer/rank exchange", timeout_s)
    if len({r[1] for r in rows}) > 1:
        raise ValueError("EPCOMM_GPUS_PER_NODE differs across ranks: "
                         + ", ".join(f"{r[1] or None} on rank {i}" for i, r in enumerate(rows)))
    return node_map([r[0] for r in rows], rows[0][1] or None)


def prepare_nvshmem(num_qps_per_rank: int, symmetric_bytes: int) -> dict:
    """Apply the NVSHMEM settings (where the user has not set them) before NVSHMEM initialises, and
    switch torch's symmetric memory to the NVSHMEM backend. Returns the settings in force. A second
    Buffer asking for other settings after NVSHMEM started gets a warning: NVSHMEM reads them once."""
    global _applied
    wanted = _env.nvshmem_settings(num_qps_per_rank, symmetric_bytes)
    if _applied is None:
        _applied = _env.apply_nvshmem_settings(wanted)
        log.info("epcomm: NVSHMEM settings %s", ", ".join(f"{k}={v} ({who})" for k, (v, who) in _applied.items()))
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
    else:
        differ = {k: v for k, v in wanted.items()
                  if k != "NVSHMEM_SYMMETRIC_SIZE" and _applied.get(k, (v,))[0] != v}
        if differ:
            log.warning("epcomm: NVSHMEM started with %s; this Buffer asks for %s, which cannot apply now",
                        {k: _applied[k][0] for k in differ}, differ)
    return dict(_applied)


def nvshmem_symmetric(nbytes: int, device, group, timeout_s: float | None = None):
    """A ``uint8[nbytes]`` NVSHMEM symmetric buffer and its rendezvous handle (after :func:`prepare_nvshmem`).
    With ``timeout_s``, every rank first passes a barrier bounded by it, and an allocation or rendezvous
    that still outlasts it is logged as an error (torch's have no deadline: ``deadline.watch``)."""
    import torch.distributed._symmetric_memory as symm_mem

    me = dist.get_rank(group)
    if timeout_s is not None:
        deadline.barrier(group, me, "Buffer/before the symmetric-memory rendezvous", timeout_s)
    with deadline.watch(me, "the NVSHMEM allocation and symmetric-memory rendezvous", timeout_s or 600.0):
        t = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        return t, symm_mem.rendezvous(t, group.group_name)


def _align(n: int, a: int = 128) -> int:
    return (n + a - 1) // a * a


def notify_words(num_ranks: int, nodes: int) -> int:
    """Words (int32) of one rank's layout row for another (module docstring), a multiple of 4."""
    from .nvlink_params import C_MAX, L_MAX

    return (2 * num_ranks + 1 + nodes + 2 * C_MAX + L_MAX + 3) // 4 * 4


def ht_region_bytes(buf, num_ranks: int, ranks_per_node: int) -> int:
    """The high-throughput region's bytes for a runtime ``buf``: ``num_nvl_bytes``, plus ``num_rdma_bytes``
    outside low-latency mode (a ``Buffer``'s, as DeepEP sizes them); for an ``ElasticBuffer``
    (``buf.elastic_shape``: its ``(M, H, K)``) at least a full call at that shape
    (``internode_ht_sizes.high_throughput_bytes``): its size follows DeepEP's V2 rules, one area of each kind, and
    this region holds two parities of each. Example: M = 4096, H = 7168, K = 8 at 2 ranks in nodes of one: the
    ElasticBuffer gives 230 MiB, a BF16 dispatch of 4096 tokens to every rank needs 451.5 MiB, this gives 452."""
    ht = buf.num_nvl_bytes + (0 if buf.low_latency_mode else buf.num_rdma_bytes)
    shape = getattr(buf, "elastic_shape", None)
    if shape is not None and not buf.low_latency_mode:
        from .internode_ht_sizes import high_throughput_bytes

        ht = max(ht, high_throughput_bytes(*shape, num_ranks, ranks_per_node))
    return ht


class InternodeBackend(Backend):
    """Low-latency and hierarchical high-throughput over NVSHMEM (module docstring).

    ``sim``: the kernels run under the Triton interpreter with the NVSHMEM calls simulated (the CPU
    emulation, ``testing/cpu_internode.py``); default: when ``TRITON_INTERPRET=1``."""

    name = "internode"
    checks_topk_on_device = True  # the LL send kernel and the HT handle kernel check the expert ids

    def __init__(self, buf, sim: bool | None = None):
        super().__init__(buf.group, buf.rank, buf.group_size, buf.device, buf.timeout_s)
        self.wait_s = buf.timeout_s  # the host's waits (barriers), in seconds even where timeout_s counts polls
        self._buf = weakref.ref(buf)
        self.sim = os.environ.get("TRITON_INTERPRET") == "1" if sim is None else bool(sim)
        from . import internode_ht, internode_ll
        from .nvlink_params import apply_tune

        # EPCOMM_TUNE keys of this backend: "iht.<key>" (high-throughput), "ill.<key>" (low-latency)
        over = _env.tune()
        apply_tune({k[4:]: v for k, v in over.items() if k.startswith("iht.")}, internode_ht.TUNE, "iht.")
        apply_tune({k[4:]: v for k, v in over.items() if k.startswith("ill.")}, internode_ll.TUNE, "ill.")
        r_ = self.num_ranks
        nodes, self.nodes_how = buf.node_map
        self.nodes = list(nodes)
        self.ranks_per_node = r_ // len(set(nodes))
        if nodes != [r // self.ranks_per_node for r in range(r_)]:
            raise ValueError(f"the internode backend needs nodes of consecutive ranks, got node map {nodes}")
        self.nvl = bool(buf.allow_nvlink_for_low_latency_mode)
        self.rdma_bytes = _align(buf.num_rdma_bytes) if buf.low_latency_mode else 0  # the LL region
        self.ll_off = 0
        self.sig_off = self.rdma_bytes
        self.mtab_off = self.sig_off + _align(2 * 3 * r_ * 8)
        self.cstage_off = self.mtab_off + _align(4 * r_)
        # the combine staging holds R*M float32 rows, at most one parity's combine area: half the LL region
        self.cstage_bytes = _align(self.rdma_bytes // 2) if buf.low_latency_mode else 0
        self.notify_off = self.cstage_off + self.cstage_bytes
        self.notify_s = notify_words(r_, r_ // self.ranks_per_node)
        self.notify_bytes = _align(2 * r_ * 8) + 3 * _align(r_ * self.notify_s * 4)
        self.ht_off = self.notify_off + self.notify_bytes
        self.ht_bytes = _align(ht_region_bytes(buf, r_, self.ranks_per_node) or DEFAULT_HT_BYTES)
        total = self.ht_off + self.ht_bytes
        if not self.sim:
            self.nvshmem_settings = prepare_nvshmem(buf.num_qps_per_rank, total)
        self.symm, self.hdl = nvshmem_symmetric(total, self.device, self.group, self.wait_s)
        self.symm.zero_()
        ptrs = [int(p) for p in self.hdl.buffer_ptrs]
        # plain stores to the ranks of this node (the HT forward and combine, the LL path with
        # allow_nvlink_for_low_latency_mode) need them mapped: NVSHMEM's P2P pointers
        node = self.rank // self.ranks_per_node
        unmapped = [r for r in range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node) if not ptrs[r]]
        if unmapped:
            raise RuntimeError(f"NVSHMEM maps no pointer to rank(s) {unmapped} of this node: the internode backend "
                               "needs peer (NVLink/P2P) access inside a node")
        self.ptr_table = torch.tensor(ptrs, dtype=torch.int64, device=self.device)
        # error word [code, peer, observed, target, host-mirror address (int64)], as the nvlink backend's
        self.err_host = torch.zeros(4, dtype=torch.int32, device="cpu").pin_memory()
        self._err_view = self.err_host.numpy()
        words = torch.zeros(8, dtype=torch.int32, device=self.device)
        self.err = words[:6]
        self.err[4:].view(torch.int64).fill_(self.err_host.data_ptr())
        # get_local_buffer_tensor's views (module docstring)
        self.nvl_buffer = self.symm[self.ht_off:self.ht_off + buf.num_nvl_bytes]
        rdma_at = self.ll_off if buf.low_latency_mode else self.ht_off + buf.num_nvl_bytes
        self.rdma_buffer = self.symm[rdma_at:rdma_at + buf.num_rdma_bytes]
        self._ll = self._ht = None
        self.sync_and_barrier("Buffer/barrier")

    # ------------------------------------------------------------------ helpers

    @property
    def timeout_ns(self) -> int:
        """The kernels' deadline: nanoseconds on a GPU, polls under the interpreter (``testing/cpu_internode``
        sets ``timeout_s`` to polls / 1e9)."""
        return int(self.timeout_s * 1e9)

    def sync_and_barrier(self, phase: str = "barrier") -> None:
        """Synchronise the device, then a barrier bounded by the deadline (``PeerTimeoutError`` naming
        ``phase``)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        deadline.barrier(self.group, self.rank, phase, self.wait_s)

    def check_mirror(self) -> None:
        """Raise if a kernel recorded an error (read from the host mirror: no device synchronisation)."""
        if self._err_view[0]:
            self._check_error(self.err_host.tolist())

    def _check_error(self, word: list[int]) -> None:
        """Raise what the error word ``word`` holds (``base.raise_error_word``); the ranks' announced M are
        in this rank's M table (kernels/internode_ll.py)."""
        raise_error_word(self, word, lambda: self.symm[self.mtab_off:self.mtab_off + 4 * self.num_ranks]
                         .view(torch.int32).tolist(), "signal")

    # ------------------------------------------------------------------ high-throughput (hierarchical)

    def _ht_impl(self):
        if self._ht is None:
            from .internode_ht import InternodeHighThroughput

            self._ht = InternodeHighThroughput(self)
        return self._ht

    def dispatch(self, args):
        self.check_mirror()  # (expert ids: checked on the device, internode_ht.py)
        return self._ht_impl().dispatch(args)

    def cached_dispatch(self, x, x_scales, handle, config=None):
        self.check_mirror()
        return self._ht_impl().cached_dispatch(x, x_scales, handle, config)

    def combine(self, x, handle, topk_weights, bias, config=None):
        self.check_mirror()
        return self._ht_impl().combine(x, handle, topk_weights, bias, config)

    # ------------------------------------------------------------------ low-latency

    def _ll_impl(self):
        if self._ll is None:
            from .internode_ll import InternodeLowLatency

            self._ll = InternodeLowLatency(self)
        return self._ll

    def low_latency_dispatch(self, args):
        self.check_mirror()
        return self._ll_impl().dispatch(args)

    def low_latency_combine(self, args):
        self.check_mirror()
        return self._ll_impl().combine(args)

    def low_latency_dispatch_run(self, args):
        self.check_mirror()
        return checked_run(self._ll_impl().dispatch_run(args), self._err_view, self.check_mirror)

    def low_latency_combine_run(self, args):
        self.check_mirror()
        return checked_run(self._ll_impl().combine_run(args), self._err_view, self.check_mirror)

    def low_latency_zero_copy_buffer(self, handle):
        return self._ll_impl().zero_copy_buffer(handle)

    def clean_low_latency_buffer(self) -> None:
        self._ll_impl().clean()

    # DeepEP V2's experimental calls: NVSHMEM symmetric memory of their own (engram.py, pp.py, agrs.py)

    def engram_plan(self, cfg, comm=None):
        from .engram import InternodeEngram

        return InternodeEngram(self, cfg, comm)

    def pp_plan(self, cfg):
        from .pp import InternodePP

        return InternodePP(self, cfg)

    def agrs_plan(self, cfg, comm=None):
        from .agrs import InternodeAGRS

        return InternodeAGRS(self, cfg, comm)

    def destroy(self) -> None:
        if not gave_up(self.group):  # (after a deadline the ranks are out of step: no collective teardown)
            self.sync_and_barrier("destroy/barrier")
        self.nvl_buffer = self.rdma_buffer = None
        if self._ll is not None:
            self._ll._plans = {}  # views into the symmetric buffer keep it alive
        self.symm = self.hdl = None


def create(buf):
    """The backend for ``buf`` (``availability`` said it can run)."""
    return InternodeBackend(buf)


def availability(buf) -> tuple[bool, str]:
    """Whether the internode backend can run for this Buffer, and why (collective: all ranks call)."""
    if buf.device.type != "cuda":
        return False, "the group is not on CUDA (gloo/CPU tensors)"
    try:
        import numpy  # noqa: F401  (the host path reads pinned words through NumPy views)
        import torch.distributed._symmetric_memory as symm_mem
        import triton  # noqa: F401

        from ..kernels import nvshmem
    except ImportError as e:
        return False, f"needs triton, numpy and torch symmetric memory ({e}); pip install triton numpy"
    if not nvshmem.available() or not symm_mem.is_nvshmem_available():
        return False, "NVSHMEM is not available to torch here (pip install nvidia-nvshmem-cu12 matching torch)"
    if torch.cuda.get_device_capability(buf.device)[0] < 8:
        return False, "needs an SM80+ GPU"
    return True, f"NVSHMEM is available ({SERVES})"
