"""Tier 3: ``ElasticBuffer``'s Engram, pipeline send/recv and AGRS calls on CUDA, on the backend the selection picks
(nvlink on one node), on the reference backend, and (two GPUs, or one shared under MPS) on the internode backend
as two virtual nodes of one rank: the checks of tier 2 (``epcomm.testing.extras_cases``: bit-exact results, every
bad input) at GPU sizes too (many programs a call, tensors of MiBs), the stream order of each call (inputs written
on the caller's stream just before the call, outputs read on it right after the hook or wait), and, on nvlink,
the kernel names DeepEP's tests time (``bench_kineto`` asserts at most one profiler row a name, and divides by
the time it finds for ``engram_fetch_impl``, ``send_impl`` and ``recv_impl``).

``EPCOMM_TEST_WORLD`` ranks (default 2); with fewer GPUs, ``EPCOMM_TEST_SHARE_GPU=1``::

    EPCOMM_TEST_SHARE_GPU=1 python -m pytest -q tests/gpu/test_elastic_extras.py
"""
import os

import pytest
import torch

from epcomm.testing.launcher import parallel_launch, share_gpu

WORLD = int(os.environ.get("EPCOMM_TEST_WORLD", "2"))
MPS_SHARE = 0 < int(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "0") or 0) <= 50
NVSHMEM_OK = torch.cuda.is_available() and (torch.cuda.device_count() >= 2 or (share_gpu(2) and MPS_SHARE))


def _make(ctx, backend):
    if backend is not None:
        os.environ["EPCOMM_BACKEND"] = backend
    if backend == "internode":
        os.environ["EPCOMM_GPUS_PER_NODE"] = "1"
    from epcomm import ElasticBuffer

    def make(**kw):
        buf = ElasticBuffer(ctx.group, **kw)
        assert buf.device.type == "cuda" and (backend is None or buf._backend.name == backend), buf._backend.name
        return buf
    return make


def _large(make, rank, r_, dev):
    """GPU sizes: Engram rows of 7168 BF16 (several column steps a row) and 512 tokens x 8 entries; PP tensors
    of 4 MiB (every SM's share, and 3 SMs); one all-gather of 8 MiB a rank (the copy engine)."""
    from epcomm.testing import extras_cases as X

    n, h, t, pe = 1000, 7168, 512, 8
    gpu, cpu = X.engram_storage_size_hint(n, h, t * pe, torch.bfloat16)
    buf = make(num_bytes=gpu + cpu, num_cpu_bytes=cpu, explicitly_destroy=True)
    allst, _ = X.engram_storage(r_, n, h, False, 77)
    buf.engram_write(allst[rank * n:(rank + 1) * n].to(dev))
    idx = torch.randint(0, r_ * n, (t, pe), generator=torch.Generator().manual_seed(rank), dtype=torch.int32)
    busy = torch.randn(4096, 4096, device=dev)
    for qps in (0, 3):
        d_idx = torch.full((t, pe), -1, dtype=torch.int32, device=dev)
        torch.matmul(busy, busy)  # work ahead on the caller's stream: the fetch must wait for the indices
        d_idx.copy_(idx.to(dev), non_blocking=True)
        data, _ = buf.engram_fetch(d_idx, num_qps=qps)()
        ok = torch.equal(data.view(torch.int16), allst[idx.reshape(-1).long()].reshape(t, pe * h).to(dev).view(
            torch.int16))  # (read right after the hook, on the caller's stream)
        assert ok, f"large engram_fetch num_qps={qps} differs"
    buf.destroy()

    nbytes = 4 << 20
    buf = make(num_bytes=X.pp_buffer_size_hint(nbytes, 2), explicitly_destroy=True)
    buf.pp_set_config(nbytes, 2)
    nxt, prv = (rank + 1) % r_, (rank - 1) % r_
    for sms in (0, 3):
        for k in range(3):
            x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
            torch.matmul(busy, busy)
            x.fill_(rank * 10 + k + sms)  # written on the caller's stream just before the send
            buf.pp_send(x, nxt, num_sms=sms)
            out = torch.empty_like(x)
            buf.pp_recv(out, prv, num_sms=sms)
            assert bool((out == prv * 10 + k + sms).all()), f"large pp_recv sms={sms} {k} differs"
    buf.destroy()

    shape = (2048, 2048)
    sess = X.agrs_session_bytes(r_, [shape], torch.bfloat16)
    buf = make(num_bytes=(sess + (2 << 20) - 1) // (2 << 20) * (2 << 20), explicitly_destroy=True)
    buf.agrs_set_config(sess, 1)
    for s in range(3):
        with buf.agrs_new_session():
            x = (buf.agrs_get_inplace_tensor(shape, torch.bfloat16) if s % 2
                 else torch.empty(shape, dtype=torch.bfloat16, device=dev))
            torch.matmul(busy, busy)
            x.fill_(rank + s)
            out, wait = buf.all_gather(x)
            wait()
            want = torch.arange(r_, device=dev, dtype=torch.bfloat16).view(-1, 1, 1) + s
            assert torch.equal(out, want.expand(r_, *shape)), f"large all_gather session {s} differs"
    buf.destroy()


def _kernel_names(make, rank, r_, dev):
    """The names DeepEP's tests look up in the profiler's table: each in exactly one row."""
    from epcomm.testing import extras_cases as X

    gpu, cpu = X.engram_storage_size_hint(64, 128, 64, torch.bfloat16)
    eng = make(num_bytes=gpu + cpu, num_cpu_bytes=cpu, explicitly_destroy=True)
    eng.engram_write(torch.zeros(64, 128, dtype=torch.bfloat16, device=dev))
    pp = make(num_bytes=X.pp_buffer_size_hint(4096, 2), explicitly_destroy=True)
    pp.pp_set_config(4096, 2)
    idx = torch.zeros(8, 8, dtype=torch.int32, device=dev)
    x, out = torch.ones(2048, dtype=torch.bfloat16, device=dev), torch.empty(2048, dtype=torch.bfloat16, device=dev)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng.engram_fetch(idx)()
            pp.pp_send(x, (rank + 1) % r_)
            pp.pp_recv(out, (rank - 1) % r_)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100).split("\n")
    for name in ("engram_fetch_impl", "send_impl", "recv_impl"):
        rows = [line for line in table if name in line]
        assert len(rows) == 1, f"{name}: {len(rows)} rows in the profile:\n" + "\n".join(table)
    assert not any("engram_fetch_wait_impl" in line for line in table)  # (no wait kernel: DeepEP's time is 0)
    eng.destroy()
    pp.destroy()


def _rank(ctx, backend):
    from epcomm.testing import extras_cases as X

    make = _make(ctx, backend)
    r, w, dev = ctx.rank, ctx.world_size, ctx.device
    X.check_engram(make, r, w, dev, fp8=False, seed=1)
    X.check_engram(make, r, w, dev, fp8=True, seed=2)
    X.check_engram_errors(make, r, w, dev)
    X.check_pp(make, r, w, dev, seed=3, num_sends=30 * w)
    X.check_pp_errors(make, r, w, dev)
    X.check_agrs(make, r, w, dev, seed=4, num_ops=24)
    X.check_agrs_errors(make, r, w, dev)
    _large(make, r, w, dev)
    probe = make(num_bytes=2 << 20, explicitly_destroy=True)
    name = probe._backend.name
    probe.destroy()
    if name == "nvlink":
        _kernel_names(make, r, w, dev)
    return name


@pytest.mark.parametrize("backend", [None, "reference"], ids=["selected", "reference"])
def test_experimental_calls_on_cuda(backend):
    res = parallel_launch(WORLD, _rank, backend, backend="nccl", timeout_s=540)
    assert len(set(res)) == 1, res


@pytest.mark.skipif(not NVSHMEM_OK, reason="NVSHMEM takes two ranks: two GPUs, or one shared under MPS at <= 50 % "
                                           "(scripts/gpu_check.sh shared-nvshmem)")
def test_experimental_calls_on_internode():
    res = parallel_launch(2, _rank, "internode", backend="nccl", timeout_s=540)
    assert set(res) == {"internode"}, res
