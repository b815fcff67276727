"""Tier 1: the nvlink backend's host code on a CPU.

Every kernel launch the backend makes is bound against its kernel's signature (a missing, unknown or
misplaced argument, or a tensor given for a constexpr, fails here instead of on the device machine),
for the eager, num_worst_tokens, cached, captured (SM push), copy-engine-chunk and low-latency calls.
The kernels are not run (tests/dist/test_nvlink_cpu.py and the sims run them under the interpreter);
CUDA streams and events are ``epcomm.testing.cpu_nvlink``'s stand-ins and symmetric memory a local
one, so the host synchronisation reads zeros (no rows arrive): this checks the orchestration only.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

triton = pytest.importorskip("triton")

from epcomm import layout  # noqa: E402
from epcomm.backends import nvlink as nv  # noqa: E402
from epcomm.backends import nvlink_params as params  # noqa: E402
from epcomm.backends.base import DispatchArgs, LowLatencyCombineArgs, LowLatencyDispatchArgs  # noqa: E402
from epcomm.kernels import ht, ht_layout, ht_notify, ht_receive, ht_transfer, ll  # noqa: E402
from epcomm.testing.cpu_nvlink import cuda_stand_ins  # noqa: E402

LLD, LLC = ll._ll_dispatch_kernel.__name__, ll._ll_combine_kernel.__name__  # the LL kernels' symbols
KERNEL_MODULES = (ht_layout, ht_notify, ht_receive, ht_transfer)  # where the backend finds its HT kernels

R, T, H, K, E = 2, 24, 256, 4, 16


class _Kernel:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kw)`` binds and records."""

    def __init__(self, jit, log: list):
        self.fn = jit.fn
        self.sig = inspect.signature(jit.fn)
        self.log = log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            for opt in ("num_warps", "num_stages", "num_ctas"):
                kwargs.pop(opt, None)
            name = self.fn.__name__
            bound = self.sig.bind(*args, **kwargs)  # TypeError: a missing or unknown argument
            assert len(grid) in (1, 2, 3) and all(isinstance(g, int) and g >= 1 for g in grid), (name, grid)
            for pname, p in self.sig.parameters.items():
                v = bound.arguments.get(pname, p.default)
                assert v is not inspect.Parameter.empty, (name, pname)
                if "constexpr" in str(p.annotation):
                    assert not isinstance(v, torch.Tensor), f"{name}: constexpr {pname} given a tensor"
                elif pname.endswith("_ptr") or pname == "ptr_table":
                    assert isinstance(v, torch.Tensor), f"{name}: {pname} must be a tensor, got {type(v).__name__}"
                else:  # a runtime scalar or a tensor; never None
                    assert v is not None, f"{name}: {pname} is None"
            self.log.append((name, tuple(grid), dict(bound.arguments)))
        return launch


class _Buf(types.SimpleNamespace):
    """The Buffer attributes the backend reads (weak-referenceable, as a Buffer is)."""


class _Symm:
    """torch.distributed._symmetric_memory for ranks built one after another in one process."""

    def __init__(self):
        self.rank = 0
        self.bufs: dict[int, list[torch.Tensor]] = {}

    def empty(self, n, dtype=torch.uint8, device=None):
        ranks = self.bufs.setdefault(n, [torch.zeros(n, dtype=dtype) for _ in range(R)])
        return ranks[self.rank]

    def rendezvous(self, t, group_name):
        ranks = self.bufs[t.numel()]
        return types.SimpleNamespace(buffer_ptrs=[b.data_ptr() for b in ranks],
                                     get_buffer=lambda r, shape, dtype: ranks[r].view(dtype).view(shape))


class _Compiled(_Kernel):
    """Stands in for a compiled kernel: ``kernels/launch.Launcher`` binds it as it binds Triton's (the first
    launch of a key goes through ``run``, checked as ``_Kernel`` checks), and later launches go straight to
    its C launcher (``Direct`` with addresses), as on a GPU host; each launch is logged (later ones without
    their arguments, which are addresses then)."""

    def __init__(self, jit, log: list):
        super().__init__(jit, log)
        self.params, self.device_caches = jit.params, {}
        name = self.fn.__name__

        class Run:
            global_scratch_size = profile_scratch_size = 0
            launch_cooperative_grid = launch_pdl = False

            @staticmethod
            def launch(gx, gy, gz, stream, function, *args):
                log.append((name, (gx, gy, gz), None))

        self.kernel = types.SimpleNamespace(run=Run(), function=0, packed_metadata=None)

    def run(self, *args, grid, warmup, **kwargs):
        self[grid](*args, **kwargs)
        return self.kernel


def make_rig(monkeypatch, compiled: bool = False):
    """The nvlink backend of ``R`` ranks in this process, its kernels stand-ins that log their launches
    (``_Kernel``; ``compiled``: ``_Compiled``, bound as on a GPU host)."""
    log: list = []
    capturing = {"on": False}
    symm = _Symm()
    mod = types.ModuleType("torch.distributed._symmetric_memory")
    mod.empty, mod.rendezvous = symm.empty, symm.rendezvous
    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", mod)
    monkeypatch.setattr(torch.distributed, "_symmetric_memory", mod, raising=False)
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(nv.deadline, "barrier", lambda *a, **k: None)  # the simulated ranks share a process
    cuda_stand_ins(monkeypatch.setattr, capturing=lambda: capturing["on"], sms=132)
    polls = nv.NVLinkBackend._await_counts

    def await_counts(self):  # the stand-in kernels set nothing: the exchange's done word is set here
        assert self._done_view[0] == 0, "the host polls a done word it did not clear before the exchange"
        self._done_view[0] = 1
        polls(self)

    monkeypatch.setattr(nv.NVLinkBackend, "_await_counts", await_counts)
    if compiled:  # the driver's current stream and device, which a launcher asks for once, at its first bind
        from triton.runtime import driver

        monkeypatch.setattr(driver, "_active", types.SimpleNamespace(get_current_stream=lambda dev: 0,
                                                                    get_current_device=lambda: 0))
    stubs: dict = {}
    for mod_ in (ht, ll, *KERNEL_MODULES):
        for name, obj in list(vars(mod_).items()):
            if isinstance(obj, triton.runtime.jit.JITFunction):
                stub = stubs.setdefault(id(obj), (_Compiled if compiled else _Kernel)(obj, log))
                monkeypatch.setattr(mod_, name, stub)
    from epcomm import Buffer

    rdma = Buffer.get_low_latency_rdma_size_hint(8, H, R, E)
    backends = []
    for r in range(R):
        symm.rank = r
        buf = _Buf(group=types.SimpleNamespace(group_name="g"), rank=r, group_size=R, device=torch.device("cpu"),
                   timeout_s=1.0, num_nvl_bytes=8 << 20, num_rdma_bytes=rdma, num_sms=24)
        b = nv.NVLinkBackend(buf)
        b.transfer = "ce"  # the copy-engine path (EPCOMM_HT_TRANSFER=ce); tests of the SM push set "sm"
        b._keep = buf  # the backend holds a weak reference
        backends.append(b)
    return types.SimpleNamespace(log=log, capturing=capturing, b=backends)


@pytest.fixture
def rig(monkeypatch):
    return make_rig(monkeypatch)


def _args(worst=0, fp8=False):
    g = torch.Generator().manual_seed(1)
    topk = torch.randint(-1, E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    scales = None
    if fp8:
        from epcomm import quant

        x, scales = quant.per_token_cast_to_fp8(x)
    per_rank, per_expert, in_rank = layout.dispatch_layout(topk, E, R)
    return DispatchArgs(x, scales, topk, w, per_rank, in_rank, per_expert, 1, worst, 8, 24)


def test_one_kernel_per_low_latency_operation_carries_a_demangled_name():
    """The one LL dispatch and combine kernel carry C++-mangled symbols, so profilers show
    ``epcomm::ll::dispatch()`` / ``epcomm::ll::combine()``: DeepEP's LL timing finds its kernels by
    ``::dispatch`` and ``::combine`` in the (demangled) names of a profile's trace events."""
    import shutil
    import subprocess

    assert (LLD, LLC) == ("_ZN6epcomm2ll8dispatchEv", "_ZN6epcomm2ll7combineEv")
    if shutil.which("c++filt"):
        out = subprocess.run(["c++filt", LLD, LLC], capture_output=True, text=True, check=True).stdout.split()
        assert out == ["epcomm::ll::dispatch()", "epcomm::ll::combine()"]


def _names(log):
    return [n for n, _, _ in log]


def test_eager_dispatch_combine_and_cached(rig):
    b = rig.b[0]
    res = b.dispatch(_args())
    assert _names(rig.log) == ["_ce_wait_kernel"] + ["_ce_signal_kernel"] * 4 + ["_dispatch_notify_kernel",
                                                                              "_dispatch_impl_kernel"]
    handle = res.handle
    assert handle.rank_prefix_matrix.shape == (R, R) and handle.send_head.shape == (T, R)
    # the eager path checks the expert ids in the exchange kernel too, before its one synchronisation, which
    # reads the counts that kernel wrote into pinned host words
    assert not rig.log[-2][2]["CHECK_WORST"] and rig.log[-2][2]["CHECK_TOPK"] and rig.log[-2][2]["HOST_COUNTS"]
    rig.log.clear()
    out, w = b.combine(res.recv_x, handle, res.recv_topk_weights, ())
    assert out.shape == (T, H) and w.shape == (T, K)
    assert _names(rig.log) == ["_ce_wait_kernel"] + ["_ce_signal_kernel"] * 4 + ["_reduce_kernel"]
    rig.log.clear()
    fp8 = _args(fp8=True)
    b.cached_dispatch(fp8.x, fp8.x_scales, handle)
    assert _names(rig.log)[-1] == "_dispatch_impl_kernel" and rig.log[-1][2]["CACHED"] and rig.log[-1][2]["HAS_SCALES"]


def test_worst_dispatch_checks_on_the_device(rig):
    b = rig.b[1]
    res = b.dispatch(_args(worst=R * T))
    assert res.recv_x.shape == (R * T, H) and res.num_recv_tokens_per_expert_list == []
    handle_launch = rig.log[-2]
    assert handle_launch[0] == "_dispatch_notify_kernel" and rig.log[-1][0] == "_dispatch_impl_kernel"
    assert handle_launch[2]["CHECK_WORST"] and handle_launch[2]["CHECK_TOPK"] and handle_launch[2]["num_worst"] == R * T
    assert not handle_launch[2]["HOST_COUNTS"]  # nothing for the host to read: no synchronisation
    rig.log.clear()
    b.combine(res.recv_x, res.handle, None, ())  # no host prefix on the handle: the SM push, in the reduce kernel
    assert _names(rig.log) == ["_combine_kernel"]


def test_captured_calls_push_with_sms(rig):
    rig.capturing["on"] = True
    rig.b[0].dispatch(_args(worst=R * T))
    # the gather kernel pushes (after notify: its own block and the push at once), no copy engine
    assert _names(rig.log) == ["_dispatch_notify_kernel", "_dispatch_impl_kernel"]
    gather = rig.log[1][2]
    assert gather["PUSH"] and gather["PUSH_TOPK"] and gather["PUSH_RB"] == params.TUNE["push_rb"]
    assert gather["PUSH_BLOCK"] == params.TUNE["push_block"] and rig.log[1][1] == (rig.b[0].num_sms, 1, 1)


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_copy_engine_chunks_raise_the_flag_by_what_they_carry(rig, monkeypatch, chunks):
    monkeypatch.setitem(params.TUNE, "ce_chunks", chunks)
    rig.b[0].dispatch(_args())
    sig = [a for n, _, a in rig.log if n == "_ce_signal_kernel"]
    assert [(a["inc"], a["bump"]) for a in sig] == [(4 // chunks, int(i == chunks - 1)) for i in range(chunks)]


@pytest.mark.parametrize("fp8", [False, True])
def test_low_latency_dispatch_split(rig, monkeypatch, fp8):
    """The dispatch's roles as separate kernels (TUNE ll.fused_dispatch off); the combine is one kernel."""
    from epcomm.backends import nvlink_ll

    monkeypatch.setitem(nvlink_ll.TUNE, "fused_dispatch", False)
    b = rig.b[0]
    m = 8
    x = torch.randn(6, H).to(torch.bfloat16)
    topk = torch.randint(-1, E, (6, K), generator=torch.Generator().manual_seed(2))
    res, recv = b.low_latency_dispatch(LowLatencyDispatchArgs(x, topk, m, E, fp8, False, False, None, None, 0, None))
    recv()
    assert _names(rig.log) == ["_ll_dispatch_send_kernel", "_ll_dispatch_recv_kernel"]
    y = torch.randn(E // R, R * m, H).to(torch.bfloat16)
    w = torch.rand(6, K)
    out, recv = b.low_latency_combine(LowLatencyCombineArgs(y, topk, w, res.handle, None, None, 1, None))
    recv()
    assert out.shape == (6, H)
    assert _names(rig.log)[2:] == ["_ZN6epcomm2ll7combineEv"]  # (_ll_combine_kernel, by its symbol)


def test_eager_calls_push_with_sms_by_default(rig, monkeypatch):
    """EPCOMM_HT_TRANSFER unset: eager calls at 2 ranks take the SM push (one gather launch that pushes),
    no copy-engine copies or flag launches."""
    monkeypatch.delenv("EPCOMM_HT_TRANSFER", raising=False)
    from epcomm import _env

    b = rig.b[0]
    b.transfer = _env.ht_transfer()
    res = b.dispatch(_args())
    assert _names(rig.log) == ["_dispatch_notify_kernel", "_dispatch_impl_kernel"] and rig.log[-1][2]["PUSH"]
    rig.log.clear()
    b.combine(res.recv_x, res.handle, res.recv_topk_weights, ())  # push and reduce: one kernel
    assert _names(rig.log) == ["_combine_kernel"]
    rig.log.clear()
    b.cached_dispatch(res.recv_x[:0].new_empty(T, H), None, res.handle)  # the gather pushes, as uncached
    assert _names(rig.log) == ["_dispatch_impl_kernel"] and rig.log[0][2]["PUSH"] and rig.log[0][2]["CACHED"]


def test_a_calls_config_sets_its_sms(rig):
    """Each call's Config.num_sms bounds its grids (DeepEP's tuning loop passes Config(24, ...) while
    Buffer.num_sms may be another value): dispatch, cached dispatch and combine."""
    import dataclasses

    from epcomm import Config

    b = rig.b[0]
    b.transfer = "sm"  # the push kernels' grids are num_sms programs
    assert b._buf().num_sms == 24
    res = b.dispatch(dataclasses.replace(_args(), num_sms=4))
    assert [g for n, g, _ in rig.log if n == "_dispatch_impl_kernel"] == [(4, 1, 1)]
    rig.log.clear()
    b.cached_dispatch(res.recv_x[:0].new_empty(T, H), None, res.handle, Config(num_sms=6))
    assert [g for n, g, _ in rig.log if n == "_dispatch_impl_kernel"] == [(6, 1, 1)]
    rig.log.clear()
    b.combine(res.recv_x, res.handle, None, (), Config(num_sms=2))
    assert [g for n, g, _ in rig.log if n == "_combine_kernel"] == [(2, 1, 1)]


def test_fused_push_grid_is_at_most_one_program_per_sm(rig):
    rig.capturing["on"] = True
    import dataclasses

    rig.b[0].dispatch(dataclasses.replace(_args(worst=R * T), num_sms=256))  # Config allows 256; the GPU has 132
    assert [g for n, g, _ in rig.log if n == "_dispatch_impl_kernel"] == [(132, 1, 1)]


def test_transfer_variable_is_checked(monkeypatch):
    from epcomm import _env

    for v, want in (("", "sm"), ("CE", "ce"), ("SM", "sm")):
        monkeypatch.setenv("EPCOMM_HT_TRANSFER", v)
        assert _env.ht_transfer() == want
    for bad in ("dma", "ce-always"):  # (ce-always, the copy engine under capture too, is gone: stale rows)
        monkeypatch.setenv("EPCOMM_HT_TRANSFER", bad)
        with pytest.raises(ValueError, match=f"EPCOMM_HT_TRANSFER must be .* got '{bad}'"):
            _env.ht_transfer()


def test_tune_variable(monkeypatch):
    saved = dict(params.TUNE)
    try:
        nv.apply_tune({"push_rb": "4"})
        assert params.TUNE["push_rb"] == 4
        from epcomm.backends import nvlink_ll

        saved_ll = dict(nvlink_ll.TUNE)
        nv.apply_tune({"send_gc": "4", "fused_dispatch": "false"}, nvlink_ll.TUNE, "ll.")
        assert nvlink_ll.TUNE["send_gc"] == 4 and nvlink_ll.TUNE["fused_dispatch"] is False
        with pytest.raises(ValueError, match="ll.fused_dispatch must be"):
            nv.apply_tune({"fused_dispatch": "maybe"}, nvlink_ll.TUNE, "ll.")
        nvlink_ll.TUNE.update(saved_ll)
        with pytest.raises(ValueError, match="unknown key 'll.push_rb'"):
            nv.apply_tune({"push_rb": "4"}, nvlink_ll.TUNE, "ll.")
        for bad, msg in (({"push_rbs": "4"}, "unknown key 'push_rbs'"),
                         ({"push_rb": "x"}, "push_rb must be an integer")):
            with pytest.raises(ValueError, match=msg):
                nv.apply_tune(bad)
    finally:
        params.TUNE.clear()
        params.TUNE.update(saved)
    from epcomm import _env

    monkeypatch.setenv("EPCOMM_TUNE", " push_rb=16, ce_chunks=2 ")
    assert _env.tune() == {"push_rb": "16", "ce_chunks": "2"}
    monkeypatch.setenv("EPCOMM_TUNE", "push_rb")
    with pytest.raises(ValueError, match="key=value"):
        _env.tune()


def test_synchronised_dispatch_may_use_fewer_copy_engine_chunks(rig, monkeypatch):
    monkeypatch.setitem(params.TUNE, "ce_chunks_sync", 1)
    rig.b[0].dispatch(_args())  # synchronises: one copy, one flag kernel
    assert [(a["inc"], a["bump"]) for n, _, a in rig.log if n == "_ce_signal_kernel"] == [(4, 1)]
    rig.log.clear()
    rig.b[0].dispatch(_args(worst=R * T))  # no synchronisation: the gather overlaps the chunks
    assert len([n for n, _, _ in rig.log if n == "_ce_signal_kernel"]) == params.TUNE["ce_chunks"]


@pytest.mark.parametrize("hook", [False, True])
def test_low_latency_dispatch_is_one_kernel(rig, hook):
    from epcomm.backends import nvlink_ll

    b, m = rig.b[0], 8  # the default: one kernel per operation
    x = torch.randn(6, H).to(torch.bfloat16)
    topk = torch.randint(-1, E, (6, K), generator=torch.Generator().manual_seed(2))
    res, recv = b.low_latency_dispatch(LowLatencyDispatchArgs(x, topk, m, E, True, False, False, None, None, 0, None,
                                                              hook=hook))
    names = _names(rig.log)
    n_gb = (H // 128 + nvlink_ll.TUNE["send_gc"] - 1) // nvlink_ll.TUNE["send_gc"]
    n_recv = (E // R) * R * nvlink_ll.TUNE["recv_split"]
    if hook:  # the hook receives later: the same kernel, first every program a sender, then a receiver
        assert names == [LLD]
        assert rig.log[0][2]["n_send"] == 6 * n_gb and rig.log[0][1] == (6 * n_gb, 1, 1)
        recv()
        assert _names(rig.log) == [LLD] * 2
        assert rig.log[1][2]["n_send"] == 0 and rig.log[1][1] == (n_recv, 1, 1)
        assert (rig.log[0][2]["ROLES"], rig.log[1][2]["ROLES"]) == (1, 2)  # each compiled for its roles
        return
    assert names == [LLD]
    launch = rig.log[0]
    assert launch[2]["ROLES"] == 3
    assert launch[2]["n_send"] == 6 * n_gb and launch[2]["n_gb"] == n_gb
    assert launch[1] == (6 * n_gb + n_recv, 1, 1)
    recv()  # nothing left to launch
    assert len(rig.log) == 1


@pytest.mark.parametrize("hook", [False, True])
def test_low_latency_combine_is_one_kernel(rig, hook):
    b, m = rig.b[0], 8
    x = torch.randn(6, H).to(torch.bfloat16)
    topk = torch.randint(-1, E, (6, K), generator=torch.Generator().manual_seed(2))
    res, recv = b.low_latency_dispatch(LowLatencyDispatchArgs(x, topk, m, E, True, False, False, None, None, 0, None))
    recv()
    rig.log.clear()
    y = torch.randn(E // R, R * m, H).to(torch.bfloat16)
    out, recv = b.low_latency_combine(LowLatencyCombineArgs(y, topk, torch.rand(6, K), res.handle, None, None, 1, None,
                                                            hook=hook))
    assert _names(rig.log) == [LLC]
    a = rig.log[0][2]
    assert a["DO_RECV"] is (not hook) and a["n_w"] == 6 and a["n_red"] == R * m * a["n_cs"]
    assert rig.log[0][1] == (a["n_w"] + a["n_red"] + (0 if hook else 6 * a["n_cb"]), 1, 1)
    recv()  # with the hook, the same kernel with receive roles only; without, nothing left
    assert _names(rig.log) == [LLC] * (2 if hook else 1)
    if hook:
        r = rig.log[1][2]
        assert r["DO_RECV"] is True and r["RECV_ONLY"] is True and r["n_w"] == 0 and r["n_red"] == 0 and rig.log[1][1] == (6 * a["n_cb"], 1, 1)


@pytest.mark.parametrize("r_pow2, expected", [(1, 3), (2, 3), (4, 1), (8, 1)])
def test_reduce_stages_fit_shared_memory(r_pow2, expected):
    from epcomm.backends.nvlink_params import SMEM_BUDGET, reduce_stages

    s = reduce_stages(r_pow2, 16, 512, stages=3)
    assert s == expected
    assert (s - 1) * 2 * r_pow2 * 16 * 512 * 2 <= SMEM_BUDGET  # 2*R bf16 tiles per step, s-1 steps ahead


def test_combine_passes_the_fitted_stages(rig, monkeypatch):
    monkeypatch.setitem(params.TUNE, "reduce_stages", 3)
    res = rig.b[0].dispatch(_args())
    rig.b[0].combine(res.recv_x, res.handle, res.recv_topk_weights, ())
    launched = [a for n, _, a in rig.log if n == "_reduce_kernel"][0]
    from epcomm.backends.nvlink_params import reduce_stages

    assert launched["STAGES"] == reduce_stages(launched["R_POW2"], launched["TB"], launched["BLOCK"])


def test_launches_and_host_synchronisations_per_call(rig, monkeypatch):
    """The host path cannot silently grow back: launches (through kernels/launch.py) and host
    synchronisations per call, for every call the backend makes."""
    from epcomm.kernels.launch import Launcher
    from epcomm.testing import cpu_nvlink

    syncs = []
    monkeypatch.setattr(cpu_nvlink.Event, "synchronize", lambda self: syncs.append("event"))
    monkeypatch.setattr(cpu_nvlink.Stream, "synchronize", lambda self: syncs.append("stream"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append("device"))
    polls = nv.NVLinkBackend._await_counts  # (the rig's: it sets the done word the host polls)
    monkeypatch.setattr(nv.NVLinkBackend, "_await_counts", lambda self: (syncs.append("poll"), polls(self))[1])
    b = rig.b[0]

    def per_call(fn, *args):
        syncs.clear()
        before = Launcher.launches
        out = fn(*args)
        return out, Launcher.launches - before, len(syncs)

    # copy engine: its wait and 4 chunk flags, the exchange (with the handle), gather; one synchronisation
    res, launches, n_sync = per_call(b.dispatch, _args())
    assert (launches, n_sync) == (7, 1)
    assert per_call(b.combine, res.recv_x, res.handle, res.recv_topk_weights, ())[1:] == (6, 0)
    assert per_call(b.cached_dispatch, res.recv_x[:0].new_empty(T, H), None, res.handle)[1:] == (6, 0)
    # num_worst_tokens: no synchronisation
    assert per_call(b.dispatch, _args(worst=R * T))[1:] == (7, 0)
    rig.capturing["on"] = True  # captured: the exchange, gather (which pushes); combine: one kernel
    res, launches, n_sync = per_call(b.dispatch, _args(worst=R * T))
    assert (launches, n_sync) == (2, 0)
    assert per_call(b.combine, res.recv_x, res.handle, None, ())[1:] == (1, 0)
    rig.capturing["on"] = False
    b.transfer = "sm"  # the default: the same eagerly, and a cached dispatch is one launch too
    res, launches, n_sync = per_call(b.dispatch, _args())
    assert (launches, n_sync) == (2, 1)
    assert per_call(b.dispatch, _args(worst=R * T))[1:] == (2, 0)
    assert per_call(b.combine, res.recv_x, res.handle, res.recv_topk_weights, ())[1:] == (1, 0)
    assert per_call(b.cached_dispatch, res.recv_x[:0].new_empty(T, H), None, res.handle)[1:] == (1, 0)
    assert per_call(b.dispatch_layout, _args().topk_idx, E)[1:] == (1, 0)
    rig.capturing["on"] = False
    # low-latency: one launch per call without the hook; with it, one now and one in hook(); never a
    # synchronisation
    m = 8
    x = torch.randn(6, H).to(torch.bfloat16)
    topk = torch.randint(-1, E, (6, K), generator=torch.Generator().manual_seed(2))
    for hook in (False, True):
        (res, recv), launches, n_sync = per_call(
            b.low_latency_dispatch, LowLatencyDispatchArgs(x, topk, m, E, True, False, False, None, None, 0, None,
                                                           hook=hook))
        assert (launches, n_sync) == (1, 0) and per_call(recv)[1:] == (int(hook), 0)
        y = torch.randn(E // R, R * m, H).to(torch.bfloat16)
        (out, recv), launches, n_sync = per_call(
            b.low_latency_combine, LowLatencyCombineArgs(y, topk, torch.rand(6, K), res.handle, None, None, 1, None,
                                                         hook=hook))
        assert (launches, n_sync) == (1, 0) and per_call(recv)[1:] == (int(hook), 0)


def test_launcher_binds_an_nvshmem_kernel_through_its_jit_function():
    """torch's ``requires_nvshmem`` hands back a wrapper (``jit_func``, ``extern_libs``): the launcher
    binds the kernel itself and passes the extern libraries on every launch through Triton, so the
    NVSHMEM kernels take the bound path like the others."""
    from epcomm.kernels.launch import Launcher

    class Wrapper:  # the shape of torch's GridCallableWithExtern
        def __init__(self, jit_func, extern_libs):
            self.jit_func, self.extern_libs = jit_func, extern_libs

    libs = {"libnvshmem_device": "/nowhere/libnvshmem_device.bc"}
    lw = Launcher(Wrapper(ll._ll_dispatch_send_kernel, libs))
    assert lw.fn is ll._ll_dispatch_send_kernel and lw.extra == {"extern_libs": libs}
    assert lw.name == Launcher(ll._ll_dispatch_send_kernel).name
    assert Launcher(ll._ll_dispatch_send_kernel).extra == {}
