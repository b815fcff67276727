"""``epcomm env`` (what this machine offers epcomm, and which backend a Buffer would pick) and
``epcomm check`` (a quick dispatch/combine self-test against the single-process oracle).

Both return text or results; the command line prints them. Nothing here runs at import.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess

import torch

from . import _env
from .bench.report import git_info, package_version
from .testing.launcher import SAFE_ENV, RankError, parallel_launch

Section = tuple[str, list[str]]

ENV_PREFIXES = ("EPCOMM_", "NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM", "TORCH_NCCL_", "CUDA_VISIBLE_DEVICES",
                "CUDA_DEVICE_MAX_CONNECTIONS")


def _safe(fn, default="unavailable"):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a doctor reports what fails instead of failing
        return f"{default} ({type(e).__name__}: {e})"


def _nccl_version() -> str:
    if not torch.cuda.is_available():
        return "n/a (no CUDA)"
    v = torch.cuda.nccl.version()
    return ".".join(str(p) for p in v) if isinstance(v, tuple) else str(v)


def _nvshmem() -> str:
    from torch.distributed import _symmetric_memory as symm_mem

    ok = symm_mem.is_nvshmem_available()
    pkgs = [f"{p} {v}" for p in ("nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13") if (v := package_version(p))]
    return ("available" if ok else "not available") + (f" ({', '.join(pkgs)})" if pkgs else "")


def versions() -> Section:
    from . import __version__

    sha, dirty = git_info()
    return ("versions", [
        f"epcomm   {__version__} (git {sha}{' +dirty' if dirty else ''})",
        f"python   {platform.python_version()} ({platform.platform()})",
        f"torch    {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        f"triton   {package_version('triton') or 'not installed'}",
        f"NCCL     {_safe(_nccl_version)}",
        f"NVSHMEM  {_safe(_nvshmem)}",
    ])


def _topology(timeout_s: float = 15.0) -> list[str]:
    if not shutil.which("nvidia-smi"):
        return ["nvidia-smi: not found"]
    try:
        p = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=timeout_s,
                           check=False)
    except subprocess.TimeoutExpired:
        return [f"nvidia-smi topo -m: no answer within {timeout_s:g} s"]
    except OSError as e:
        return [f"nvidia-smi topo -m: {e}"]
    text = (p.stdout or p.stderr).rstrip()
    return ["nvidia-smi topo -m:"] + ["  " + line for line in text.splitlines()]


def gpus() -> Section:
    if not torch.cuda.is_available():
        return ("GPUs", ["no CUDA GPU visible (torch.cuda.is_available() is False): "
                         + "Buffers run on gloo with CPU tensors"])
    n = torch.cuda.device_count()
    lines = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"cuda:{i}  {p.name}  sm_{p.major}{p.minor}  {p.total_memory / 2**30:.0f} GiB  "
                     f"{p.multi_processor_count} SMs")
    if n > 1:
        lines.append("peer access (row can access column):")
        lines.append("        " + " ".join(f"{j:>5}" for j in range(n)))
        for i in range(n):
            cells = ["  -  " if i == j else ("  yes" if torch.cuda.can_device_access_peer(i, j) else "   NO")
                     for j in range(n)]
            lines.append(f"  {i:>4}  " + " ".join(cells))
    lines += _topology()
    return ("GPUs", lines)


def _symm_probe(ctx) -> str:
    from torch.distributed import _symmetric_memory as symm_mem

    t = symm_mem.empty(1024, dtype=torch.uint8, device=ctx.device)
    h = symm_mem.rendezvous(t, ctx.group)
    return f"works (1-rank group: rank {h.rank} of {h.world_size}, backend {symm_mem.get_backend(ctx.device)})"


def symmetric_memory(probe: bool) -> Section:
    lines = []
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError as e:
        return ("symmetric memory", [f"torch.distributed._symmetric_memory: not importable ({e})"])
    lines.append(f"NVSHMEM backend: {_safe(_nvshmem)}")
    if not torch.cuda.is_available():
        lines.append("CUDA backend: n/a (no CUDA GPU)")
    elif not probe:
        lines.append("CUDA backend: untested without a process group (`epcomm env --probe` tries a 1-rank group)")
    else:
        try:
            lines.append("CUDA backend: " + parallel_launch(1, _symm_probe, backend="nccl", timeout_s=120)[0])
        except RankError as e:
            last = [ln for ln in str(e).splitlines() if ln.strip()][-1]
            lines.append(f"CUDA backend: FAILED on a 1-rank group: {last}")
    if torch.cuda.is_available():
        lines.append(f"current backend for cuda: {_safe(lambda: symm_mem.get_backend('cuda'))}")
    return ("symmetric memory", lines)


def variables() -> Section:
    lines = ["epcomm reads (epcomm._env.VARIABLES):"]
    for name, what in _env.VARIABLES.items():
        lines.append(f"  {name}={os.environ.get(name, '')!s:<10}  {what}" if name in os.environ
                     else f"  {name} (unset)  {what}")
    others = sorted(k for k in os.environ if k.startswith(ENV_PREFIXES) and k not in _env.VARIABLES)
    lines.append("set in this environment (NCCL / NVSHMEM / symmetric memory / CUDA):")
    lines += [f"  {k}={os.environ[k]}" for k in others] or ["  (none)"]
    lines.append("epcomm's launcher sets in every rank: " + ", ".join(f"{k}={v}" for k, v in SAFE_ENV.items()))
    return ("environment variables", lines)


def deep_ep_switch() -> Section:
    """Whether ``import deep_ep`` gives epcomm here (``EPCOMM_AS_DEEP_EP``), whether the start-up hook is
    installed, and whether a real DeepEP is shadowed (docs/clients.md)."""
    import sys

    import _epcomm_as_deep_ep as hook

    lines = []
    try:
        on = hook.switch_on()
    except ValueError as e:
        on = None
        lines.append(f"switch: error: {e}")
    else:
        lines.append(f"switch: {hook.VARIABLE}={'on' if on else 'off'}"
                     + ("" if on else f" (set {hook.VARIABLE}=1 to give every process epcomm as deep_ep)"))
    pths = hook.pth_files()
    lines.append(f"start-up hook: {', '.join(pths)}" if pths else
                 f"start-up hook: {hook.PTH_NAME} is in no site directory of this interpreter: the switch "
                 "does nothing here; reinstall epcomm (pip install . or pip install -e .)")
    real = hook.real_deep_ep_origin()
    loaded = sys.modules.get(hook.NAME)
    if on and hook.installed():
        gives = "epcomm (epcomm/_deep_ep)"
    elif on:
        gives = "not epcomm: the switch is on but the hook did not run in this process (see start-up hook)"
    else:
        gives = f"the real DeepEP ({real})" if real else "nothing (ImportError)"
    if loaded is not None:
        gives += f"; already imported here from {getattr(loaded, '__file__', '?')}"
    lines.append(f"import deep_ep gives: {gives}")
    if real is None:
        lines.append("real DeepEP: not installed")
    elif on:
        lines.append(f"real DeepEP: installed at {real}, SHADOWED: epcomm wins while the switch is on")
    else:
        lines.append(f"real DeepEP: installed at {real}, in use (the switch is off)")
    return ("deep_ep (EPCOMM_AS_DEEP_EP)", lines)


def _gpus_per_node() -> int | None:
    try:
        return _env.gpus_per_node()
    except ValueError:
        return None  # the internode section reports the error


def backend_choice() -> Section:
    """Which backend a Buffer would pick here and why, by the rule of ``epcomm.backends``."""
    from . import backends

    rule = (backends.__doc__ or "").strip().splitlines()
    lines = ["rule (epcomm.backends):"] + ["  " + ln for ln in rule[1:] if ln.strip()]
    forced = _env.backend()
    if forced is not None:
        if forced not in backends.BACKENDS:
            verdict = f"error: EPCOMM_BACKEND={forced!r} is not one of {backends.BACKENDS}"
        else:
            verdict = f"{forced} (forced by EPCOMM_BACKEND; raises if it cannot run)"
    elif not torch.cuda.is_available():
        verdict = "reference: the group is not on CUDA (gloo/CPU tensors)"
    elif (_gpus_per_node() or 1 << 30) < torch.cuda.device_count():
        from .backends.internode import SERVES

        verdict = f"internode for a group of this host's GPUs (virtual nodes) where NVSHMEM comes up: {SERVES}"
    elif package_version("triton") is None:
        verdict = "reference: triton is not installed (pip install 'epcomm[triton]')"
    else:
        try:
            importlib.import_module(".nvlink", backends.__name__)
        except ImportError as e:
            verdict = f"reference: nvlink backend unavailable: {e}"
        else:
            n = torch.cuda.device_count()
            peers = all(torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j)
            verdict = ("nvlink on an NCCL group of this host's GPUs (the backend confirms at Buffer creation: "
                       "peer access, symmetric memory)" if peers else
                       "reference: some GPU pairs lack peer access (nvlink needs it)")
    lines.append(f"here: {verdict}")
    return ("backend a Buffer would choose", lines)


def internode() -> Section:
    """Virtual nodes, the NVSHMEM settings a Buffer applies before NVSHMEM starts, and whether a group across
    nodes would run the internode backend here (backends/internode.py)."""
    from .backends import internode as inter

    lines = []
    try:
        n = _env.gpus_per_node()
    except ValueError as e:
        n, lines = None, [f"virtual nodes: error: {e}"]
    if not lines:
        lines.append(f"virtual nodes: EPCOMM_GPUS_PER_NODE={n}: a group of R ranks forms R/{n} nodes" if n else
                     "virtual nodes: off (EPCOMM_GPUS_PER_NODE unset: a node is a host)")
    nic = _env.has_rdma_nic()
    lines.append("RDMA NIC: " + ("present (/sys/class/infiniband): IBGDA preferred" if nic else
                                 "none (/sys/class/infiniband empty): NVSHMEM's P2P transport only, one host"))
    lines.append("NVSHMEM settings a Buffer applies before NVSHMEM starts (num_qps_per_rank=24; a value you set "
                 "wins):")
    for k, v in _env.nvshmem_settings(24, 0, nic).items():
        mine = os.environ.get(k)
        lines.append(f"  {k}={v}" + (f"  (set here to {mine}: yours is kept)" if mine not in (None, v) else ""))
    for k in ("NVSHMEM_IB_TRAFFIC_CLASS", "NVSHMEM_IB_SL"):
        lines.append(f"  {k}={os.environ[k]}  (yours)" if k in os.environ else
                     f"  {k} (unset: NVSHMEM's default; set it for your RoCE fabric's lossless class)")
    lines.append(f"a group across nodes runs: internode where NVSHMEM comes up (else reference): {inter.SERVES}")
    return ("internode (NVSHMEM)", lines)


def env_report(probe: bool = False) -> str:
    sections = [versions(), gpus(), symmetric_memory(probe), variables(), deep_ep_switch(), internode(),
                backend_choice()]
    out = []
    for title, lines in sections:
        out.append(f"== {title}")
        out += lines
        out.append("")
    return "\n".join(out).rstrip() + "\n"


# ----------------------------------------------------------------------------- epcomm check


def _check_worker(ctx) -> dict:
    """Dispatch and combine a small seeded case; compare with the oracle. Returns findings."""
    from . import Buffer
    from .testing.compare import assert_bitwise, assert_within_budget
    from .testing.inputs import Case, expected_dispatch, make_topk, make_x

    r_, me, dev = ctx.world_size, ctx.rank, ctx.device
    case = Case(num_ranks=r_, tokens=tuple(24 + 8 * r for r in range(r_)), hidden=256, num_topk=4,
                num_experts=8 * r_, seed=7)
    nvl = max(cfg.get_nvl_buffer_size_hint(case.hidden * 2, r_)
              for cfg in (Buffer.get_dispatch_config(r_), Buffer.get_combine_config(r_)))
    buf = Buffer(ctx.group, num_nvl_bytes=nvl)
    x = make_x(case, me).to(dev)
    idx, w = (t.to(dev) for t in make_topk(case, me))
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, case.num_experts)
    recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w)
    combined = buf.combine(recv_x, handle)[0]
    exp = expected_dispatch(case, me)
    failures = []
    for what, fn in (
        ("recv_x", lambda: assert_bitwise(recv_x, exp["recv_x"], "recv_x")),
        ("recv_topk_idx", lambda: assert_bitwise(recv_idx, exp["recv_topk_idx"], "recv_topk_idx")),
        ("recv_topk_weights", lambda: assert_bitwise(recv_w, exp["recv_topk_weights"], "recv_topk_weights")),
        ("recv_src_idx", lambda: assert_bitwise(handle.recv_src_idx, exp["recv_src_idx"], "recv_src_idx")),
        ("combine", lambda: assert_within_budget(
            combined, x.double().cpu() * in_rank.sum(1, keepdim=True).double().cpu(),
            x.abs().double().cpu() * in_rank.sum(1, keepdim=True).double().cpu(), r_, "combine")),
    ):
        try:
            fn()
        except AssertionError as e:
            failures.append(f"{what}: {str(e).splitlines()[0]}")
    if list(per_expert_list) != exp["per_expert"].tolist():
        failures.append(f"num_recv_tokens_per_expert_list {list(per_expert_list)} != {exp['per_expert'].tolist()}")
    return {"rank": me, "backend": buf.backend_name, "received": int(recv_x.shape[0]), "failures": failures}


def run_check(world_size: int | None = None, device: str = "auto", timeout_s: float = 180.0) -> tuple[bool, str]:
    """Launch the self-test; returns ``(passed, report text)``."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= 2)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible")
    if world_size is None:
        world_size = min(torch.cuda.device_count(), 8) if use_cuda else 2
    transport = "nccl" if use_cuda else "gloo"
    lines = [f"epcomm check: {world_size} ranks on {transport}, dispatch + combine of a seeded case vs the oracle"]
    try:
        res = parallel_launch(world_size, _check_worker, backend=transport, timeout_s=timeout_s)
    except RankError as e:
        return False, "\n".join(lines + [f"FAIL: {e}"])
    ok = True
    for r in res:
        status = "ok" if not r["failures"] else "FAIL"
        ok &= not r["failures"]
        lines.append(f"  rank {r['rank']}: backend {r['backend']}, received {r['received']} tokens: {status}")
        lines += [f"    {f}" for f in r["failures"]]
    lines.append("PASS" if ok else "FAIL")
    return ok, "\n".join(lines)
