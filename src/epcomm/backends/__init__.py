"""Backend selection. The rule (logged at INFO by ``Buffer``):

1. ``EPCOMM_BACKEND`` forces a backend; a forced backend that cannot run raises, never falls back.
2. A CUDA group whose ranks span several nodes (hosts, or virtual nodes of ``EPCOMM_GPUS_PER_NODE``
   ranks) uses ``internode`` when it can run (NVSHMEM comes up; backends/internode.py says why not),
   else ``reference``.
3. Otherwise a CUDA group whose ranks share one host with peer access uses ``nvlink`` when it is
   available (Triton importable, symmetric memory works); everything else uses ``reference``.
"""

from __future__ import annotations

import importlib

BACKENDS = ("reference", "nvlink", "internode")


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
    if forced == "internode" or (forced is None and buf.device.type == "cuda"):
        from . import internode

        nodes, how = buf.node_map  # internode.group_nodes, read by the Buffer
        if forced == "internode" or len(set(nodes)) > 1:
            ok, why = internode.availability(buf)
            if ok:
                return internode.create(buf), f"{how}: {why}"
            if forced == "internode":
                raise RuntimeError(f"EPCOMM_BACKEND=internode cannot run here: {why}")
            reason = f"{how}: internode unavailable: {why}"
            from .reference import ReferenceBackend

            return ReferenceBackend(buf.group, buf.rank, buf.group_size, buf.device, buf.timeout_s,
                                    buf.num_nvl_bytes, buf.num_rdma_bytes), reason
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
