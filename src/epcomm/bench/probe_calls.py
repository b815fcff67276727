"""The buffers and the calls that ``bench/hostprobe.py`` times: a world-1 ``Buffer`` or ``ElasticBuffer`` on the
CPU rig (``bench/probe_rig.install``) or on a GPU, and per API the call kinds as ``epcomm bench`` makes them
(``ll_calls``, ``ht_calls``, ``v2_calls``: ``name -> (prep, call)``, each warmed up: checks, binding, plans).

hostprobe loads this file from its own tree, whichever tree it probes (that tree's epcomm is imported here,
lazily): a probe of an older tree times the same calls.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``M`` max tokens a rank.
"""

from __future__ import annotations


def _choose_nvlink(set_attr=setattr) -> None:
    """Point the backend choice of the probed tree at the nvlink backend: ``runtime.select_backend`` (or, in
    a tree from before ``runtime.py``, ``buffer.select_backend``)."""
    import importlib

    from epcomm.backends.nvlink import NVLinkBackend

    for name in ("epcomm.runtime", "epcomm.buffer"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "select_backend"):
            set_attr(mod, "select_backend", lambda buf: (NVLinkBackend(buf), "the host probe"))


def cpu_buffer(m: int, h: int, e: int, set_attr=setattr):
    """A world-1 ``Buffer`` on gloo whose backend is the nvlink backend (after :func:`install`)."""
    import torch.distributed as dist

    from epcomm import Buffer

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _choose_nvlink(set_attr)
    rdma = Buffer.get_low_latency_rdma_size_hint(m, h, 1, e)
    return Buffer(dist.group.WORLD, num_rdma_bytes=rdma, low_latency_mode=True)


def v2_buffer(m: int, h: int, k: int, cpu: bool):
    """A world-1 ``ElasticBuffer`` sized for ``(m, h, k)``: on the CPU rig (``cpu``, after :func:`install`)
    its engine's backend the nvlink backend, else on NCCL (real kernels)."""
    import torch
    import torch.distributed as dist

    from epcomm.elastic import ElasticBuffer

    if not dist.is_initialized():
        if not cpu:
            torch.cuda.set_device(0)
        dist.init_process_group("gloo" if cpu else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    if cpu:
        _choose_nvlink()
    return ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=m, hidden=h, num_topk=k)


def ht_buffer(t: int, h: int, k: int, cpu: bool):
    """A world-1 ``Buffer`` for high-throughput calls of ``t`` tokens (``num_nvl_bytes`` as ``epcomm bench``
    sizes it): on the CPU rig (``cpu``, after :func:`install`) on the nvlink backend, else on NCCL."""
    import torch
    import torch.distributed as dist

    from epcomm import Buffer

    if not dist.is_initialized():
        if not cpu:
            torch.cuda.set_device(0)
        dist.init_process_group("gloo" if cpu else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    if cpu:
        _choose_nvlink()
    hint = max(c.get_nvl_buffer_size_hint(h * 2, 1) for c in (ht_config(24), ht_config(24, True)))
    nvl = (max(hint, 2 * t * (h * 2 + 4 * (h // 128) + 12 * k + 16)) + (2 << 20)) >> 20 << 20
    return Buffer(dist.group.WORLD, num_nvl_bytes=nvl)


def ht_config(sms: int, combine: bool = False):
    """The default ``Config`` at ``sms`` SMs (world 1), as ``epcomm bench`` passes it."""
    from epcomm import Config

    return (Config.default_combine if combine else Config.default_dispatch)(1, sms)


def gpu_buffer(m: int, h: int, e: int):
    """A world-1 ``Buffer`` on NCCL (real kernels)."""
    import torch
    import torch.distributed as dist

    from epcomm import Buffer

    if not dist.is_initialized():
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    return Buffer(dist.group.WORLD, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(m, h, 1, e),
                  low_latency_mode=True)


# ----------------------------------------------------------------------------- the calls


def ll_calls(buf, t: int, m: int, h: int, k: int, e: int, hook: bool = False, seed: int = 0) -> dict:
    """``name -> (prep, call)``: each call kind as ``epcomm bench`` times it (``prep`` untimed, may be
    None). Each call's first run (its checks, its binding) happens here."""
    import torch

    dev = buf.device
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    topk = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev) if t else \
        torch.empty(0, k, dtype=torch.int64, device=dev)
    w = torch.rand(t, k, generator=g).to(dev)
    y = torch.empty(e, m, h, dtype=torch.bfloat16, device=dev)  # L = E at world 1; values do not matter
    if dev.type == "cuda":
        y.normal_()
    state: dict = {}

    def dispatch():
        out = buf.low_latency_dispatch(x, topk, m, e, use_fp8=True, return_recv_hook=hook)
        state["handle"] = out[2]
        return out

    def combine():
        return buf.low_latency_combine(y, topk, w, state["handle"], return_recv_hook=hook)

    def dispatched():  # the combine's untimed dispatch, received
        out = dispatch()
        if hook:
            out[-1]()

    tag = "+hook" if hook else ""
    calls = {f"dispatch{tag}": (None, dispatch), f"combine{tag}": (dispatched, combine)}
    for prep, call in calls.values():
        for i in range(9):  # every parity's kind seen twice (checks, then binding), whatever the phase
            if i == 4:
                dispatched()  # a combine after a dispatch of the other parity
            if prep is not None:
                prep()
            out = call()
            if hook:
                out[-1]()
    return calls


def _warm(calls: dict, n: int = 3) -> dict:
    """Each call's first runs (its checks, its binding, its plan), ``n`` of each, its ``prep`` before each."""
    for prep, call in calls.values():
        for _ in range(n):
            if prep is not None:
                prep()
            call()
    return calls


def _ht_inputs(buf, t: int, h: int, k: int, e: int, seed: int):
    """``(x bf16[T, H], topk_idx int64[T, K] (distinct experts), topk_weights f32[T, K])`` on ``buf``'s device;
    on the CPU rig the counts a synchronised dispatch reads, written where the layout exchange writes them
    (world 1: ``counts[0][0] = T``, then ``T*K/E`` an expert, as uniform routing gives), and its poll of the
    exchange's done word a return (the rig launches nothing)."""
    import torch

    dev = buf.device
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    topk = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
    w = torch.rand(t, k, generator=g).to(dev)
    host = getattr(buf._backend, "_notify_view", None)
    if dev.type == "cpu" and host is not None:
        host[0] = t
        host[1:1 + e] = t * k // e
        # no kernel runs to set the done word the host polls: the poll as it finds the word already set
        buf._backend._await_counts = lambda: None
    return x, topk, w


def v2_calls(buf, t: int, m: int, h: int, k: int, e: int, sms: int = 24, seed: int = 0) -> dict:
    """``name -> (prep, call)``: ``ElasticBuffer`` calls as ``epcomm bench --api v2`` times them (BF16, the
    top-k weights given, alignment 1 contiguous and 128 expanded, ``num_sms`` fixed); ``d``: dispatch,
    ``c``: contiguous, ``x``: expanded, ``s``: with CPU sync; ``cached``: a dispatch on a no-sync handle;
    ``combine``: the weights sent back, after an untimed no-sync dispatch; ``dc fp8``: the contiguous no-sync
    dispatch of FP8 rows with fp32 scales. On the CPU rig a synchronised
    dispatch reads counts the probe wrote where the layout exchange writes them (``T`` rows, ``T*K/LE``
    an expert, as uniform routing gives). Each call's first run (checks, binding) happens here."""
    import torch

    x, topk, w = _ht_inputs(buf, t, h, k, e, seed)
    state: dict = {}

    x8 = (x.to(torch.float8_e4m3fn), torch.ones(t, h // 128, device=buf.device))

    def dispatch(expand: bool, sync: bool, data=x):
        kw = dict(topk_idx=topk, topk_weights=w, num_experts=e, num_max_tokens_per_rank=m,
                  expert_alignment=128 if expand else 1, do_expand=expand, do_cpu_sync=sync, num_sms=sms)
        return lambda: state.__setitem__(expand, buf.dispatch(data, **kw))

    def combine(expand: bool):
        return lambda: buf.combine(state[expand][0], state[expand][3], topk_weights=state[expand][2], num_sms=sms)

    calls = {}
    for expand, tag in ((False, "c"), (True, "x")):
        for sync in (False, True):
            calls[f"d{tag}{'s' if sync else ''}"] = (None, dispatch(expand, sync))
        calls[f"combine {tag}"] = (dispatch(expand, False), combine(expand))
    calls["cached c"] = (dispatch(False, False), lambda: buf.dispatch(x, handle=state[False][3], num_sms=sms))
    calls["dc fp8"] = (None, dispatch(False, False, x8))
    return _warm(calls)


def ht_calls(buf, t: int, h: int, k: int, e: int, sms: int = 24, seed: int = 0) -> dict:
    """``name -> (prep, call)``: ``Buffer``'s high-throughput calls as ``epcomm bench`` times them (BF16, the
    default ``Config``s at ``sms`` SMs): ``layout`` (``get_dispatch_layout``), ``dispatch`` (its outputs
    given; CPU sync), ``layout+dispatch`` (both, as a caller makes them), ``worst`` (``num_worst_tokens``:
    no sync), ``worst fp8``, ``cached`` and ``combine`` (the weights back, after an untimed dispatch). On
    the CPU rig a synchronised dispatch reads counts the probe wrote where the exchange writes them."""
    import torch

    x, topk, w = _ht_inputs(buf, t, h, k, e, seed)
    x8 = (x.to(torch.float8_e4m3fn), torch.ones(t, h // 128, device=buf.device))
    cfg, ccfg = ht_config(sms), ht_config(sms, True)
    st: dict = {"layout": buf.get_dispatch_layout(topk, e)}

    def layout():
        st["layout"] = buf.get_dispatch_layout(topk, e)

    def dispatch(data=x, worst=0):
        per_rank, _, per_expert, in_rank, _ = st["layout"]
        st["out"] = buf.dispatch(data, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                 num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w,
                                 num_worst_tokens=worst, config=cfg)

    def both():
        layout()
        dispatch()

    calls = {"layout": (None, layout), "dispatch": (None, dispatch), "layout+dispatch": (None, both),
             "worst": (None, lambda: dispatch(worst=t)), "worst fp8": (None, lambda: dispatch(x8, t)),
             "cached": (dispatch, lambda: buf.dispatch(x, handle=st["out"][4], config=cfg)),
             "combine": (dispatch, lambda: buf.combine(st["out"][0], st["out"][4], st["out"][2], config=ccfg))}
    return _warm(calls)
