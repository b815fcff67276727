"""Backend selection. The rule (logged at INFO by ``Buffer``):

1. ``EPCOMM_BACKEND`` forces a backend; a forced backend that cannot run raises, never falls back.
2. Otherwise a CUDA group whose ranks share one host with peer access uses ``nvlink`` when it is
   available (Triton importable, symmetric memory works); everything else uses ``reference``.
"""

from __future__ import annotations

import importlib

BACKENDS = ("reference", "nvlink")


def _nvlink_status(buf) -> tuple[bool, str]:
    """Can the nvlink backend run for this Buffer? ``(ok, reason)``; imports lazily."""
    if buf.device.type != "cuda":
        return False, "the group is not on CUDA (gloo/CPU tensors)"
    try:
        mod = importlib.import_module(".nvlink", __name__)
    except ImportError as e:
        return False, f"nvlink backend unavailable: {e}"
    return mod.availability(buf)


def select_backend(buf):
    """Return ``(backend instance, reason)`` for ``buf`` (an ``epcomm.Buffer`` being constructed)."""
    from .. import _env

    forced = _env.backend()
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"EPCOMM_BACKEND={forced!r} is not one of {BACKENDS}")
    if forced == "nvlink" or forced is None:
        ok, why = _nvlink_status(buf)
        if ok:
            from .nvlink import NVLinkBackend

            return NVLinkBackend.create(buf), ("forced by EPCOMM_BACKEND" if forced else why)
        if forced == "nvlink":
            raise RuntimeError(f"EPCOMM_BACKEND=nvlink cannot run here: {why}")
        reason = why
    else:
        reason = "forced by EPCOMM_BACKEND"
    from .reference import ReferenceBackend

    backend = ReferenceBackend(buf.group, buf.rank, buf.group_size, buf.device, buf.timeout_s,
                               buf.num_nvl_bytes, buf.num_rdma_bytes)
    return backend, reason
