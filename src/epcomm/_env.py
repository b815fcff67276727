"""The few environment variables epcomm reads, all in one place (listed by ``epcomm env``)."""

from __future__ import annotations

import os

VARIABLES = {
    "EPCOMM_BACKEND": "force a backend: reference | nvlink | internode (a forced backend that cannot run raises)",
    "EPCOMM_GPUS_PER_NODE": "virtual nodes: split the group's ranks into nodes of N consecutive ranks (N divides "
                            "the group size; a node never spans hosts), so the internode paths run on one "
                            "host; unset: a node is a host",
    "EPCOMM_TIMEOUT_S": "deadline in seconds for every wait on a peer (default 30 on CPU, 10 on GPU)",
    "EPCOMM_LOG_LEVEL": "log level of the epcomm logger (e.g. INFO to see which backend runs and why)",
    "EPCOMM_HT_TRANSFER": "nvlink high-throughput bulk mover: sm (default: the Triton push kernels, one launch) | ce "
                          "(the copy engine for eager calls, SMs for calls captured in a CUDA graph; a copy and a flag "
                          "launch per peer)",
    "EPCOMM_VERIFY_LAUNCH": "1: every Triton launch also runs Triton's binder and checks that the kernel bound once "
                            "for its key is the one Triton would pick (slow; the GPU tests set it)",
    "EPCOMM_AS_DEEP_EP": "1: every Python process that imports deep_ep (Megatron-Core, vLLM, SGLang, ...) "
                         "gets epcomm, even where a real DeepEP is installed (a .pth hook installed with "
                         "epcomm; docs/clients.md); 0 or unset: nothing named deep_ep is provided",
    "EPCOMM_NATIVE": "the nvlink plans' native path, every part of it: a call's outputs, its launches and "
                     "its kind from its tensors through a small C++ extension (epcomm/native.cpp), built or "
                     "loaded when a buffer is made (a C++ compiler and ninja; ~25-40 s once a machine, then "
                     "cached): 1 (default: on CUDA devices; the plain torch path where it cannot be built) | "
                     "0 (off: the plain torch path) | all (also on CPU devices: the tests)",
    "EPCOMM_TUNE": "launch parameters, e.g. push_rb=16,ce_chunks=2,ll.send_gc=16,iht.dispatch_warps=8 (keys "
                   "and defaults: TUNE in backends/nvlink_params.py; ll. keys: backends/nvlink_ll.py; iht. "
                   "and ill. keys, the internode backend's: backends/internode_ht.py and internode_ll.py): "
                   "launch constants, and two switches, ll.fused_dispatch and iht.p2p "
                   "(docs/architecture.md); for measuring variants with epcomm bench",
    "EPCOMM_COMMIT": "the commit of the epcomm tree being run, for copies without .git (a GPU machine's copy): "
                     "epcomm bench records it in every row; run scripts set it from the tree they ship",
    "EPCOMM_COMMIT_DIRTY": "with EPCOMM_COMMIT: 1 if that tree had uncommitted changes, 0 if clean (unset: unknown)",
}


def native() -> str:
    """``EPCOMM_NATIVE``: ``"1"`` (default), ``"0"`` or ``"all"`` (epcomm/native.py)."""
    return os.environ.get("EPCOMM_NATIVE", "1").strip().lower() or "1"


def verify_launch() -> bool:
    """``EPCOMM_VERIFY_LAUNCH=1``: every kernel launch also checks its bound specialisation (kernels/launch.py)."""
    return os.environ.get("EPCOMM_VERIFY_LAUNCH", "") == "1"


def backend() -> str | None:
    v = os.environ.get("EPCOMM_BACKEND", "").strip().lower()
    return v or None


class Seconds(float):
    """A deadline in seconds that knows what set it (``source``: ``"EPCOMM_TIMEOUT_S"``,
    ``"num_cpu_timeout_secs"``, ...), so that a wait that passes it names it (``backends.errors``). A plain
    float is a default deadline. Example: ``Seconds(12, "num_cpu_timeout_secs")`` is 12.0 wherever a float is
    used."""

    source: str

    def __new__(cls, value: float, source: str = ""):  # (a default: pickle makes it from the value alone)
        s = super().__new__(cls, value)
        s.source = source
        return s


def timeout_s(default: float | None) -> float | None:
    """``EPCOMM_TIMEOUT_S`` as a ``Seconds`` naming it where set, else ``default`` as given."""
    v = os.environ.get("EPCOMM_TIMEOUT_S")
    if not v:
        return default
    try:
        t = float(v)
    except ValueError:
        raise ValueError(f"EPCOMM_TIMEOUT_S must be a number of seconds, got {v!r}") from None
    if t <= 0:
        raise ValueError(f"EPCOMM_TIMEOUT_S must be positive, got {v!r}")
    return Seconds(t, "EPCOMM_TIMEOUT_S")


def commit() -> tuple[str | None, bool | None]:
    """``(EPCOMM_COMMIT, EPCOMM_COMMIT_DIRTY)``: a 7-40 hex digit sha (else ValueError) and 1/0 (else
    ValueError); ``(None, None)`` when EPCOMM_COMMIT is unset."""
    sha = os.environ.get("EPCOMM_COMMIT", "").strip().lower()
    if not sha:
        return None, None
    if not 7 <= len(sha) <= 40 or any(c not in "0123456789abcdef" for c in sha):
        raise ValueError(f"EPCOMM_COMMIT must be a git commit sha (7-40 hex digits), got {sha!r}")
    dirty = os.environ.get("EPCOMM_COMMIT_DIRTY", "").strip()
    if dirty not in ("", "0", "1"):
        raise ValueError(f"EPCOMM_COMMIT_DIRTY must be 0 or 1, got {dirty!r}")
    return sha, None if dirty == "" else dirty == "1"


def log_level() -> str | None:
    return os.environ.get("EPCOMM_LOG_LEVEL") or None


def ht_transfer() -> str:
    v = os.environ.get("EPCOMM_HT_TRANSFER", "sm").strip().lower() or "sm"
    if v not in ("ce", "sm"):
        raise ValueError(f"EPCOMM_HT_TRANSFER must be 'ce' or 'sm', got {v!r}")
    return v


def tune() -> dict[str, str]:
    """``EPCOMM_TUNE`` as ``{key: value}`` (strings; the backend checks keys and converts values)."""
    v = os.environ.get("EPCOMM_TUNE", "").strip()
    out = {}
    for item in filter(None, (p.strip() for p in v.split(","))):
        key, eq, val = item.partition("=")
        if not eq or not key.strip() or not val.strip():
            raise ValueError(f"EPCOMM_TUNE must be key=value pairs separated by commas, got {v!r}")
        out[key.strip()] = val.strip()
    return out


def gpus_per_node() -> int | None:
    """``EPCOMM_GPUS_PER_NODE`` as a positive int, or None when unset (a node is then a host)."""
    v = os.environ.get("EPCOMM_GPUS_PER_NODE", "").strip()
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"EPCOMM_GPUS_PER_NODE must be a positive integer, got {v!r}") from None
    if n < 1:
        raise ValueError(f"EPCOMM_GPUS_PER_NODE must be a positive integer, got {v!r}")
    return n


# NVSHMEM's own variables that the internode backend sets, where the user has not, before NVSHMEM
# initialises (names checked against the NVSHMEM 3.x environment-variable reference; NVSHMEM reads them
# once, at its initialisation, which torch runs lazily at the first NVSHMEM symmetric allocation).
# Traffic class and service level are the user's to set (NVSHMEM_IB_TRAFFIC_CLASS, NVSHMEM_IB_SL);
# ``epcomm env`` reports them with every other NVSHMEM_* variable.
NVSHMEM_FIXED = {
    "NVSHMEM_QP_DEPTH": "1024",  # deeper than the work requests a kernel keeps in flight per queue pair
    "NVSHMEM_MAX_TEAMS": "7",  # the default teams and one more: less GPU memory per PE
    "NVSHMEM_DISABLE_NVLS": "1",  # no NVLink SHARP resources (epcomm does no NVSHMEM collectives)
}


def has_rdma_nic(sys_root: str = "/sys/class/infiniband") -> bool:
    """Whether this host shows an InfiniBand/RoCE device (where IBGDA can run)."""
    try:
        return bool(os.listdir(sys_root))
    except OSError:
        return False


def nvshmem_settings(num_qps_per_rank: int, symmetric_bytes: int, rdma_nic: bool | None = None) -> dict:
    """The NVSHMEM variables a Buffer asks for: ``{name: value}``.

    ``num_qps_per_rank`` -> ``NVSHMEM_IBGDA_NUM_RC_PER_PE`` (queue pairs per peer: traffic spreads
    over both ports of a dual-port NIC); IBGDA (the GPU posts RDMA itself) where an RDMA NIC exists
    (``NVSHMEM_IB_ENABLE_IBGDA=1``; without one, NVSHMEM's P2P transport serves one host);
    ``NVSHMEM_SYMMETRIC_SIZE`` large enough for ``symmetric_bytes`` plus 256 MiB of headroom.
    """
    if num_qps_per_rank < 1:
        raise ValueError(f"num_qps_per_rank must be >= 1, got {num_qps_per_rank}")
    nic = has_rdma_nic() if rdma_nic is None else rdma_nic
    out = dict(NVSHMEM_FIXED)
    out["NVSHMEM_IBGDA_NUM_RC_PER_PE"] = str(num_qps_per_rank)
    if nic:
        out["NVSHMEM_IB_ENABLE_IBGDA"] = "1"
    heap = max(1 << 30, (symmetric_bytes + (256 << 20) + (1 << 21) - 1) // (1 << 21) * (1 << 21))
    out["NVSHMEM_SYMMETRIC_SIZE"] = str(heap)
    return out


def apply_nvshmem_settings(wanted: dict, environ=os.environ) -> dict:
    """Set each of ``wanted`` that the user has not set; return ``{name: (value in force, 'epcomm' | 'user')}``.
    Must run before NVSHMEM initialises (it reads its variables once)."""
    out = {}
    for k, v in wanted.items():
        if k in environ and environ[k] != v:
            out[k] = (environ[k], "user")
        else:
            environ[k] = v
            out[k] = (v, "epcomm")
    return out
