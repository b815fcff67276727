"""The few environment variables epcomm reads, all in one place (listed by ``epcomm env``)."""

from __future__ import annotations

import os

VARIABLES = {
    "EPCOMM_BACKEND": "force a backend: reference | nvlink (a forced backend that cannot run raises)",
    "EPCOMM_TIMEOUT_S": "deadline in seconds for every wait on a peer (default 30 on CPU, 10 on GPU)",
    "EPCOMM_LOG_LEVEL": "log level of the epcomm logger (e.g. INFO to see which backend runs and why)",
    "EPCOMM_HT_TRANSFER": "nvlink high-throughput bulk mover: ce (default: copy engine for eager calls, SMs for calls "
                          "captured in a CUDA graph) | sm (Triton push kernels always) | ce-always (the copy engine "
                          "under capture too; diagnostic: it delivered stale rows under replay on H200, 2026-11-22)",
    "EPCOMM_VERIFY_LAUNCH": "1: every Triton launch also runs Triton's binder and checks that the kernel bound once "
                            "for its key is the one Triton would pick (slow; the GPU tests set it)",
    "EPCOMM_AS_DEEP_EP": "1: every Python process that imports deep_ep (Megatron-Core, vLLM, SGLang, ...) "
                         "gets epcomm, even where a real DeepEP is installed (a .pth hook installed with "
                         "epcomm; docs/clients.md); 0 or unset: nothing named deep_ep is provided",
    "EPCOMM_TUNE": "nvlink launch parameters, e.g. push_rb=16,ce_flag=copy,ll.fused_dispatch=1 (keys and defaults: "
                   "TUNE in backends/nvlink_params.py; ll. keys: TUNE in backends/nvlink_ll.py; for measuring "
                   "variants with epcomm bench)",
}


def verify_launch() -> bool:
    """``EPCOMM_VERIFY_LAUNCH=1``: every kernel launch also checks its bound specialisation (kernels/launch.py)."""
    return os.environ.get("EPCOMM_VERIFY_LAUNCH", "") == "1"


def backend() -> str | None:
    v = os.environ.get("EPCOMM_BACKEND", "").strip().lower()
    return v or None


def timeout_s(default: float) -> float:
    v = os.environ.get("EPCOMM_TIMEOUT_S")
    if not v:
        return default
    try:
        t = float(v)
    except ValueError:
        raise ValueError(f"EPCOMM_TIMEOUT_S must be a number of seconds, got {v!r}") from None
    if t <= 0:
        raise ValueError(f"EPCOMM_TIMEOUT_S must be positive, got {v!r}")
    return t


def log_level() -> str | None:
    return os.environ.get("EPCOMM_LOG_LEVEL") or None


def ht_transfer() -> str:
    v = os.environ.get("EPCOMM_HT_TRANSFER", "ce").strip().lower() or "ce"
    if v not in ("ce", "sm", "ce-always"):
        raise ValueError(f"EPCOMM_HT_TRANSFER must be 'ce', 'sm' or 'ce-always', got {v!r}")
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


def as_deep_ep() -> bool:
    """``EPCOMM_AS_DEEP_EP``: whether epcomm answers ``import deep_ep`` (the rule lives in the torch-free
    start-up hook ``_epcomm_as_deep_ep``, which reads it before anything else can)."""
    from _epcomm_as_deep_ep import switch_on

    return switch_on()
