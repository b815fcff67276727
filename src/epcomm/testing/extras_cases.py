"""Checks of ``ElasticBuffer``'s Engram, pipeline send/recv and AGRS calls (``elastic_extras.py``), used by tier 2
(every backend on CPU processes) and tier 3 (GPUs).

Every rank's data comes from seeds, so any rank knows what any peer holds and sends: the oracle is written out the
plain way (indexing of the whole storage, the sender's own tensor), never with the library's code. Each check takes
``make(**kw) -> ElasticBuffer`` (the backend under test), the rank, the world size and the device, and raises
``AssertionError`` saying what differs. Letters: ``R`` ranks, ``N`` entries a rank, ``H`` hidden, ``T`` tokens,
``PE`` entries a token, ``PK`` scale packs.
"""

from __future__ import annotations

import random

import torch

from ..elastic_extras import agrs_session_bytes, engram_storage_size_hint, pp_buffer_size_hint


def _eq(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.cpu(), want.cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"{what}: {got.dtype}{tuple(got.shape)} != expected {want.dtype}{tuple(want.shape)}")
    if not torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                       want.view(torch.uint8) if want.element_size() == 1 else want):
        raise AssertionError(f"{what}: values differ\n{got}\n!= expected\n{want}")


def raises(exc, match: str, fn, *a, **kw) -> str:
    """``fn(*a, **kw)`` must raise ``exc`` with ``match`` in its message; returns the message."""
    try:
        fn(*a, **kw)
    except exc as e:
        if match not in str(e):
            raise AssertionError(f"{fn.__name__}: raised {type(e).__name__}({e}) without {match!r}") from e
        return str(e)
    except Exception as e:  # a wrong kind of error is the failure reported
        raise AssertionError(f"{fn.__name__}: raised {type(e).__name__}({e}), expected {_names(exc)}") from e
    raise AssertionError(f"{fn.__name__}: raised nothing, expected {_names(exc)}({match!r}...)")


def _settle(device) -> None:
    """Wait for the device: a plan's next call raises what a kernel recorded only once that kernel has run (the host
    reads the error word without waiting for the device)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _names(exc) -> str:
    return " or ".join(e.__name__ for e in (exc if isinstance(exc, tuple) else (exc,)))


# ----------------------------------------------------------------------------------------------- Engram


def engram_storage(num_ranks: int, n: int, h: int, fp8: bool, seed: int):
    """``(storage of every rank [R*N, H], sf [R*N, PK] or None)``: BF16, or FP8 with 4-byte packs of arbitrary bits
    (int32; the library moves them as they are)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_ranks * n, h, generator=g)
    if not fp8:
        return x.to(torch.bfloat16), None
    sf = torch.randint(-2**31, 2**31 - 1, (num_ranks * n, 3), generator=g, dtype=torch.int64).to(torch.int32)
    return (x * 16).clamp(-440, 440).to(torch.float8_e4m3fn), sf


def check_engram(make, rank: int, num_ranks: int, device, fp8: bool, seed: int = 0) -> None:
    """Write, fetch (both scale layouts, several ``num_qps``, empty), write again, fetch again: the rows and scales
    of the indices, bit for bit, with DeepEP's shapes and strides."""
    n, h, t, pe = 13, 40 if not fp8 else 72, 7, 3
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    gpu, cpu = engram_storage_size_hint(n, h, t * pe, dtype)
    buf = make(num_bytes=gpu + cpu, num_cpu_bytes=cpu, explicitly_destroy=True)
    g = torch.Generator().manual_seed(seed * 100 + rank)
    for round_ in range(2):  # (a second write of other data, the same shape: the same plan)
        allst, allsf = engram_storage(num_ranks, n, h, fp8, seed * 10 + round_)
        sf = None if allsf is None else allsf.to(device)
        buf.engram_write(allst[rank * n:(rank + 1) * n].contiguous().to(device), sf=sf)
        for tt, qps in ((t, 0), (t, 1), (2, 3), (0, 0)):
            idx = torch.randint(0, num_ranks * n, (tt, pe), generator=g, dtype=torch.int32)
            if tt:
                idx[0, 0], idx[-1, -1] = 0, num_ranks * n - 1  # the first and the last entry of all
            want = allst[idx.reshape(-1).long()].reshape(tt, pe * h)
            for tma in ((False, True) if fp8 else (False,)):
                hook = buf.engram_fetch(idx.to(device), num_qps=qps, use_tma_aligned_col_major_sf=tma)
                data, got_sf = hook()
                what = f"engram_fetch round {round_} T={tt} num_qps={qps} tma={tma}"
                _eq(f"{what} data", data, want)
                if not fp8:
                    if got_sf is not None:
                        raise AssertionError(f"{what}: BF16 storage gave scales")
                    continue
                _eq(f"{what} sf", got_sf, allsf[idx.reshape(-1).long()].reshape(tt, pe * 3))
                stride = (1, (max(tt, 1) + 3) // 4 * 4) if tma else (pe * 3, 1)
                if tt and got_sf.stride() != stride:
                    raise AssertionError(f"{what}: sf strides {got_sf.stride()} != {stride}")
    buf.destroy()


def check_engram_errors(make, rank: int, num_ranks: int, device) -> None:
    """Each bad Engram input raises its named error on every rank, and a good call after it still works."""
    n, h = 6, 16
    gpu, cpu = engram_storage_size_hint(n, h, 8, torch.bfloat16)
    buf = make(num_bytes=gpu + cpu, num_cpu_bytes=cpu, explicitly_destroy=True)
    allst, _ = engram_storage(num_ranks, n, h, False, 5)
    mine = allst[rank * n:(rank + 1) * n].contiguous().to(device)
    idx = torch.zeros(2, 2, dtype=torch.int32, device=device)
    raises(RuntimeError, "engram_fetch before engram_write", buf.engram_fetch, idx)
    raises(TypeError, "torch.bfloat16 or torch.float8_e4m3fn", buf.engram_write, mine.float())
    raises(ValueError, "sf must be given exactly when storage is FP8", buf.engram_write, mine,
           torch.zeros(num_ranks * n, 1, device=device))
    raises(ValueError, "exceeds num_cpu_bytes", buf.engram_write, torch.zeros(cpu // (2 * h) + 1, h,
                                                                                dtype=torch.bfloat16, device=device))
    # one rank's bad storage: every rank raises (the others name it)
    bad = torch.zeros(n, h, dtype=torch.float32, device=device) if rank == num_ranks - 1 else mine
    raises((TypeError, ValueError), "torch.bfloat16" if rank == num_ranks - 1 else f"rank(s) [{num_ranks - 1}]",
           buf.engram_write, bad)
    # storages of other shapes on different ranks
    raises(ValueError, "arguments differ", buf.engram_write, mine[:n - (rank % 2)].contiguous())
    buf.engram_write(mine)
    total = num_ranks * n

    def fetch_then_hook(i):
        hook = buf.engram_fetch(i)
        _settle(device)  # the hook raises what the kernel recorded once it has run (else the next Engram call does)
        return hook()

    for v in (total, -1):
        bad_idx = torch.tensor([[0, v]], dtype=torch.int32, device=device)
        raises(ValueError, "outside [0,", fetch_then_hook, bad_idx)
    raises(TypeError, "indices must have dtype torch.int32", buf.engram_fetch, idx.long())
    raises(ValueError, "indices must be 2-D", buf.engram_fetch, idx.view(-1))
    raises(ValueError, "num_qps must be <=", buf.engram_fetch, idx, num_qps=buf.num_allocated_qps + 1)
    raises(ValueError, "needs", buf.engram_fetch, torch.zeros(gpu // (2 * h) + 1, 1, dtype=torch.int32, device=device))
    good = torch.tensor([[total - 1, 0]], dtype=torch.int32, device=device)
    data, _ = buf.engram_fetch(good)()
    _eq("engram_fetch after bad calls", data, allst[[total - 1, 0]].reshape(1, 2 * h))
    buf.destroy()


# ----------------------------------------------------------------------------------------------- pipeline


def pp_schedule(num_ranks: int, num_sends: int, inflight: int, seed: int):
    """``[(time, op, src, dst, i)]`` sorted by time: up to ``num_sends`` tensors to ring neighbours at random times,
    the ``i``-th of a direction received after the ``i - 1``-th, and a tensor kept only where fewer than
    ``inflight`` earlier tensors of its direction are still unreceived when it is sent (a send that waits for a
    free slot then always has a receive before it to wait for, so no schedule deadlocks)."""
    rng = random.Random(seed)
    sends = sorted((rng.randrange(10 ** 6), src, (src + rng.choice((1, -1))) % num_ranks)
                   for src in (rng.randrange(num_ranks) for _ in range(num_sends)))
    recvs: dict[tuple[int, int], list[int]] = {}
    ops = []
    for st, src, dst in sends:
        times = recvs.setdefault((src, dst), [])
        if sum(rt > st for rt in times) >= inflight:
            continue
        rt = max([st] + times) + rng.randrange(1, 3 * 10 ** 4)
        ops += [(st, "send", src, dst, len(times)), (rt, "recv", src, dst, len(times))]
        times.append(rt)
    return sorted(ops)


_PP_KINDS = ((torch.bfloat16, (9, 7)), (torch.int8, (5,)), (torch.float32, (3, 4)), (torch.int8, (0,)),
             (torch.float16, (17,)))


def pp_tensor(src: int, dst: int, i: int, seed: int) -> torch.Tensor:
    """The ``i``-th tensor ``src`` sends ``dst``: a dtype and shape of its own (odd byte counts, an empty one)."""
    dtype, shape = _PP_KINDS[(src * 7 + dst * 3 + i) % len(_PP_KINDS)]
    g = torch.Generator().manual_seed(seed * 10007 + src * 101 + dst * 13 + i)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-128, 127, shape, generator=g, dtype=torch.int64).to(dtype)


def check_pp(make, rank: int, num_ranks: int, device, seed: int = 0, num_sends: int = 40, inflight: int = 2) -> None:
    """A random schedule of sends to ring neighbours (``pp_schedule``), every tensor received bit-exact into a
    tensor of its dtype and shape; then ``inflight`` sends in a row before any receive (credit flow control)."""
    max_bytes = max(torch.tensor([], dtype=d).element_size() * int(torch.Size(s).numel()) for d, s in _PP_KINDS)
    buf = make(num_bytes=pp_buffer_size_hint(max_bytes, inflight), explicitly_destroy=True)
    buf.pp_set_config(max_bytes, inflight)
    for s in range(2):
        for _, op, src, dst, i in pp_schedule(num_ranks, num_sends, inflight, seed * 10 + s):
            want = pp_tensor(src, dst, i, seed * 10 + s)
            if op == "send" and src == rank:
                buf.pp_send(want.to(device), dst)
            elif op == "recv" and dst == rank:
                got = torch.empty_like(want, device=device)
                buf.pp_recv(got, src)
                _eq(f"pp_recv seed {seed * 10 + s}: tensor {i} from rank {src}", got, want)
    nxt, prv = (rank + 1) % num_ranks, (rank - 1) % num_ranks
    sent = [pp_tensor(rank, nxt, 1000 + j, seed) for j in range(inflight)]
    for x in sent:
        buf.pp_send(x.to(device), nxt, num_sms=2)
    for j in range(inflight):
        want = pp_tensor(prv, rank, 1000 + j, seed)
        got = torch.empty_like(want, device=device)
        buf.pp_recv(got, prv, num_sms=1)
        _eq(f"pp_recv of {inflight} sends in a row: {j}", got, want)
    buf.destroy()


def check_pp_errors(make, rank: int, num_ranks: int, device) -> None:
    """Each bad pipeline input raises its named error before anything is sent: the tensors that follow pair up."""
    nbytes = 64
    buf = make(num_bytes=pp_buffer_size_hint(nbytes, 2), explicitly_destroy=True)
    t = torch.arange(16, dtype=torch.int32, device=device)
    raises(RuntimeError, "pp_send before pp_set_config", buf.pp_send, t, (rank + 1) % num_ranks)
    raises(ValueError, "needs num_bytes >=", buf.pp_set_config, 1 << 30, 2)
    raises(ValueError, "arguments differ", buf.pp_set_config, nbytes, 1 + rank % 2)
    buf.pp_set_config(nbytes, 2)
    nxt, prv = (rank + 1) % num_ranks, (rank - 1) % num_ranks
    if num_ranks > 3:
        far = (rank + 2) % num_ranks
        raises(ValueError, "is not a ring neighbour", buf.pp_send, t, far)
        raises(ValueError, "is not a ring neighbour", buf.pp_recv, t, far)
    raises(ValueError, "is not a ring neighbour", buf.pp_send, t, rank)
    raises(ValueError, "more than num_max_tensor_bytes", buf.pp_send, torch.zeros(nbytes + 1, dtype=torch.int8,
                                                                                   device=device), nxt)
    raises(ValueError, "more than num_max_tensor_bytes", buf.pp_recv, torch.zeros(17, dtype=torch.int32,
                                                                                   device=device), prv)
    raises(ValueError, "must be contiguous", buf.pp_send, t.view(4, 4).t(), nxt)
    raises(TypeError, "dst_rank_idx must be an int", buf.pp_send, t, float(nxt))
    raises(ValueError, "num_sms must be >= 0", buf.pp_send, t, nxt, -1)
    buf.pp_send(t + 100 * rank, nxt)
    got = torch.empty_like(t)
    buf.pp_recv(got, prv)
    _eq("pp_recv after bad calls", got, torch.arange(16, dtype=torch.int32) + 100 * prv)
    # a receive whose tensor is not the size sent: a ValueError naming the sender and both sizes, on the receiving
    # rank (the reference at the call; nvlink and internode from the plan's next call once the kernel has recorded
    # it: the test waits for the device in between)
    buf.pp_send(t, nxt)
    small = torch.empty(8, dtype=torch.int32, device=device)

    def mismatched():
        buf.pp_recv(small, prv)
        _settle(device)
        buf.pp_recv(small, prv)

    raises(ValueError, f"pp_recv: rank {prv} sent a tensor of 64 bytes, this receive takes 32", mismatched)
    buf.destroy()
    if buf._x_pp is not None:
        raise AssertionError("destroy() kept the pipeline plan (and its symmetric memory)")
    raises(RuntimeError, "destroyed", buf.pp_send, t, nxt)


# ----------------------------------------------------------------------------------------------- AGRS


def agrs_tensor(op: int, rank: int, shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100003 + op * 101 + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g, dtype=torch.int64).to(dtype)


_AG_KINDS = ((torch.bfloat16, (4, 6)), (torch.int8, (3, 5)), (torch.float32, (7,)), (torch.bfloat16, (2, 0)))


def check_agrs(make, rank: int, num_ranks: int, device, seed: int = 0, num_ops: int = 24, max_ag: int = 4) -> None:
    """DeepEP's stress shape: sessions of up to ``max_ag`` all-gathers, single or batched, in place or not, their
    waits in random order, every gathered tensor equal to the stack of every rank's input (odd byte counts, an
    empty tensor); then a second configuration."""
    rng = random.Random(seed)  # the same on every rank: the ops are collective
    sess = agrs_session_bytes(num_ranks, [s for _, s in _AG_KINDS] * max_ag, torch.float32)
    buf = make(num_bytes=(sess + (2 << 20) - 1) // (2 << 20) * (2 << 20), explicitly_destroy=True)
    buf.agrs_set_config(sess, max_ag)
    todo = list(range(num_ops))
    results = {}
    while todo:
        buf.create_agrs_session()
        inflight, used = [], 0
        while todo and used < max_ag and rng.random() < 0.85:
            k = rng.randint(1, min(3, len(todo)))
            ops, todo = todo[:k], todo[k:]
            kinds = [_AG_KINDS[(op * 5 + seed) % len(_AG_KINDS)] for op in ops]
            mine = [agrs_tensor(op, rank, s, d, seed).to(device) for op, (d, s) in zip(ops, kinds)]
            if rng.random() < 0.5:
                places = buf.agrs_get_inplace_tensor([s for _, s in kinds], mine[0].dtype) if \
                    len({d for d, _ in kinds}) == 1 else None
                if places is not None:
                    for p, x in zip(places, mine):
                        p.copy_(x)
                    mine = list(places)
            if len(mine) == 1 and rng.random() < 0.5:
                out, h = buf.all_gather(mine[0])
                outs = [out]
            else:
                *outs, h = buf.all_gather(tuple(mine))
            inflight.append((ops, kinds, outs, h))
            used += 1
            if rng.random() < 0.3:
                rng.shuffle(inflight)
                ops_, _, outs_, h_ = inflight.pop()
                h_()
                results.update({op: o.clone() for op, o in zip(ops_, outs_)})
        rng.shuffle(inflight)
        for ops_, _, outs_, h_ in inflight:
            h_()
            results.update({op: o.clone() for op, o in zip(ops_, outs_)})
        buf.destroy_agrs_session()
    for op in range(num_ops):
        d, s = _AG_KINDS[(op * 5 + seed) % len(_AG_KINDS)]
        want = torch.stack([agrs_tensor(op, r, s, d, seed) for r in range(num_ranks)])
        _eq(f"all_gather op {op} ({d}{s})", results[op], want)
    buf.agrs_set_config(sess // 2, 2)  # a second configuration: a new plan
    with buf.agrs_new_session():
        x = agrs_tensor(999, rank, (5,), torch.float32, seed).to(device)
        out, h = buf.all_gather(x)
        h()
        _eq("all_gather after agrs_set_config again", out,
            torch.stack([agrs_tensor(999, r, (5,), torch.float32, seed) for r in range(num_ranks)]))
    buf.destroy()


def check_agrs_errors(make, rank: int, num_ranks: int, device) -> None:
    """Each bad AGRS input or call outside a session raises its named error before anything is sent."""
    x = torch.full((4,), float(rank), device=device)
    sess = agrs_session_bytes(num_ranks, [(4,)] * 2, torch.float32)
    buf = make(num_bytes=2 << 20, explicitly_destroy=True)
    raises(RuntimeError, "create_agrs_session before agrs_set_config", buf.create_agrs_session)
    raises(ValueError, "must be <= 32", buf.agrs_set_config, sess, 33)
    raises(ValueError, "exceeds num_bytes", buf.agrs_set_config, (2 << 20) + 32, 2)
    raises(ValueError, "arguments differ", buf.agrs_set_config, sess, 1 + rank % 2)
    buf.agrs_set_config(sess, 2)
    raises(RuntimeError, "all_gather outside an AGRS session", buf.all_gather, x)
    raises(RuntimeError, "agrs_get_inplace_tensor outside an AGRS session", buf.agrs_get_inplace_tensor, (4,),
           torch.float32)
    raises(RuntimeError, "destroy_agrs_session outside", buf.destroy_agrs_session)
    buf.create_agrs_session()
    raises(RuntimeError, "inside an AGRS session", buf.create_agrs_session)
    raises(RuntimeError, "inside an AGRS session", buf.agrs_set_config, sess, 2)
    raises(ValueError, "more than num_max_session_bytes", buf.all_gather, torch.zeros(64, device=device))
    raises(ValueError, "more than num_max_session_bytes", buf.agrs_get_inplace_tensor, (64,), torch.float32)
    raises(ValueError, "must be contiguous", buf.all_gather, torch.zeros(4, 2, device=device).t())
    raises(ValueError, "at least one tensor", buf.all_gather, ())
    wrong = buf.agrs_get_inplace_tensor((4,), torch.float32)[1:]  # in the buffer, but not where (3,) would go
    raises(ValueError, "not at this all-gather's place", buf.all_gather, wrong)
    out1, h1 = buf.all_gather(x)
    out2, h2 = buf.all_gather(x + 1)
    raises(ValueError, "already holds num_max_all_gathers_per_session=2", buf.all_gather, x)
    raises(ValueError, "already holds", buf.agrs_get_inplace_tensor, (4,), torch.float32)
    h1()
    h2()
    want = torch.arange(num_ranks, dtype=torch.float32).view(-1, 1).expand(num_ranks, 4)
    _eq("all_gather after bad calls", out1, want)
    _eq("all_gather after bad calls (second)", out2, want + 1)
    buf.destroy_agrs_session()
    raises(RuntimeError, "after its session ended", h1)
    with buf.agrs_new_session():
        out, h = buf.all_gather(x * 2)
        h()
        _eq("all_gather in the next session", out, want * 2)
    buf.destroy()
    if buf._x_agrs is not None:
        raise AssertionError("destroy() kept the AGRS plan (and its symmetric memory)")
    raises(RuntimeError, "destroyed", buf.create_agrs_session)


# ----------------------------------------------------------------------------------------------- deadlines


def check_deadlines(make, rank: int, num_ranks: int, device, device_plans: bool, done_path: str) -> None:
    """A receive whose peer never sends, and (``device_plans``: nvlink, internode) an all-gather a peer never
    joins, give up at the deadline with ``PeerTimeoutError`` naming the phase and the peer: raised by the call on
    the reference, by the plan's next call where a kernel waited (the kernel records it in the plan's error word).
    Rank 0 waits; the others call nothing, and stay alive until rank 0 has created ``done_path`` (a peer that
    exits is lost, not late). The group is out of step afterwards: run it last."""
    import os
    import time

    os.environ["EPCOMM_TIMEOUT_S"] = "3"  # (read when a buffer is made; the CPU emulations count spins instead)
    buf = make(num_bytes=pp_buffer_size_hint(64, 1), explicitly_destroy=True)
    buf.pp_set_config(64, 1)
    agrs = None
    if device_plans:
        agrs = make(num_bytes=2 << 20, explicitly_destroy=True)
        agrs.agrs_set_config(1024, 2)
        if device.type == "cpu":  # a CPU emulation: its kernels' waits count spins, 2e4 of them here
            for b in (buf, agrs):
                b._backend.timeout_s = 2e4 / 1e9
    if rank != 0:
        end = time.monotonic() + 600
        while not os.path.exists(done_path) and time.monotonic() < end:
            time.sleep(0.2)
        return
    try:
        _time_out(buf, agrs, device)
    finally:
        open(done_path, "w").close()


def _time_out(buf, agrs, device) -> None:
    from ..backends.errors import PeerTimeoutError

    t = torch.empty(16, dtype=torch.int32, device=device)

    def recv_twice():
        buf.pp_recv(t, 1)
        _settle(device)
        buf.pp_recv(t, 1)
    msg = raises(PeerTimeoutError, "pp_recv/receive-data", recv_twice)
    if "for rank 1" not in msg:
        raise AssertionError(f"the receive's timeout does not name the peer: {msg}")
    if agrs is not None:
        agrs.create_agrs_session()
        agrs.all_gather(t)
        _settle(device)
        msg = raises(PeerTimeoutError, "all_gather/receive-data", agrs.all_gather, t)
        if "for rank 1" not in msg:
            raise AssertionError(f"the all-gather's timeout does not name the peer: {msg}")
