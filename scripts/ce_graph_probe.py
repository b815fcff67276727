"""GPU probe (2 ranks; nvidia-h200-x2): which transfer keeps its data ahead of its flag, eager and
under CUDA-graph replay.

Why: in the third session of 2026-11-22 the high-throughput copy-engine dispatch (copies into the
peer's staging on a forked stream, then a kernel that raises the peer's flag) delivered stale rows
at the end of copy chunks 0-2 on every graph replay, while the same calls eager were right; a
stream memory barrier (cuStreamWriteValue32) between the copies and the flag kernel did not help.
This probe isolates the question with one rank-to-rank transfer of ``T`` rows of ``H`` bf16 in
``NC`` chunks (each rank sends to the other; the receiver's kernel waits chunk by chunk, then copies
the chunk out of its staging) and counts, per variant and mode, the calls whose output differs from
the peer's input:

- ``ce-fork-kflag``: copy engine on a forked stream, flag raised by a kernel (the current design);
- ``ce-same-kflag``: the same on the calling stream (no fork);
- ``ce-fork-ceflag``: the flag written by the copy engine too (a 4-byte copy of a device word that
  a kernel set to the level), right after the chunk;
- ``pull``: the sender copies x into its own symmetric outbox (local copy engine) and raises a
  ready flag; the receiver's copy engine reads the peer's outbox into its local staging; its kernel
  then reads local memory written by its own stream;
- ``sm-push``: a kernel stores the rows into the peer's staging and raises the flag (release).

Run it through the device tool: ``python3 scripts/ce_graph_probe.py`` (~1 min). A wait has a 2 s
deadline (a lost flag shows as "timeout", never a hang).
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epcomm.kernels.common import signal, wait_ge  # noqa: E402
from epcomm.testing.launcher import parallel_launch  # noqa: E402

T, H, NC = int(os.environ.get("PROBE_T", "512")), 7168, 4
CALLS = int(os.environ.get("PROBE_CALLS", "12"))
TIMEOUT_NS = 2_000_000_000
VARIANTS = ("ce-fork-kflag", "ce-same-kflag", "ce-fork-ceflag", "pull", "sm-push")


@triton.jit
def _signal_kernel(flag_ptr, value):
    signal(flag_ptr, value)


@triton.jit
def _set_level_kernel(ctr_ptr, word_ptr, c, NC: tl.constexpr):
    tl.store(word_ptr, tl.load(ctr_ptr) * NC + c + 1)


@triton.jit
def _wait_level_kernel(flag_ptr, ctr_ptr, mul, add, err_ptr, timeout_ns):
    wait_ge(flag_ptr, tl.load(ctr_ptr) * mul + add, err_ptr, 3, 0, timeout_ns, True)


@triton.jit
def _bump_kernel(ctr_ptr):
    tl.store(ctr_ptr, tl.load(ctr_ptr) + 1)


@triton.jit
def _copy_chunk(dst_ptr, src_ptr, c, per_rows, T, row_words, BLOCK: tl.constexpr):
    """Rows ``[c * per_rows, min((c + 1) * per_rows, T))`` of ``src`` to the same rows of ``dst``."""
    lo = c * per_rows
    hi = tl.minimum(lo + per_rows, T)
    cols = tl.arange(0, BLOCK)
    for r in range(lo, hi):
        base = r.to(tl.int64) * row_words
        for h0 in range(0, row_words, BLOCK):
            m = h0 + cols < row_words
            tl.store(dst_ptr + base + h0 + cols, tl.load(src_ptr + base + h0 + cols, mask=m), mask=m)


@triton.jit
def _recv_kernel(flag_ptr, ctr_ptr, src_ptr, out_ptr, per_rows, T, row_words, err_ptr, timeout_ns,
                 NC: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``c``: wait until the flag reaches this call's level for chunk ``c``, then copy the
    chunk's rows from the staging to the output."""
    c = tl.program_id(0)
    wait_ge(flag_ptr, tl.load(ctr_ptr) * NC + c + 1, err_ptr, 3, 0, timeout_ns, True)
    _copy_chunk(out_ptr, src_ptr, c, per_rows, T, row_words, BLOCK)


@triton.jit
def _push_kernel(x_ptr, dst_ptr, flag_ptr, per_rows, T, row_words, NC: tl.constexpr, BLOCK: tl.constexpr):
    _copy_chunk(dst_ptr, x_ptr, tl.program_id(0), per_rows, T, row_words, BLOCK)
    signal(flag_ptr, 1)


class _Variant:
    """One variant's symmetric buffer: [flags: 64 int32][staging T x H bf16][outbox T x H bf16]."""

    def __init__(self, name: str, group, dev):
        import torch.distributed._symmetric_memory as symm_mem

        self.name, self.dev = name, dev
        self.me = dist.get_rank(group)
        self.peer = 1 - self.me
        self.row_bytes = H * 2
        self.data_bytes = T * self.row_bytes
        total = 256 + 2 * self.data_bytes
        self.symm = symm_mem.empty(total, dtype=torch.uint8, device=dev)
        self.symm.zero_()
        self.hdl = symm_mem.rendezvous(self.symm, dist.group.WORLD.group_name)
        self.remote = self.hdl.get_buffer(self.peer, (total,), torch.uint8)
        self.ctr = torch.zeros(1, dtype=torch.int32, device=dev)
        self.words = torch.zeros(NC, dtype=torch.int32, device=dev)
        self.err = torch.zeros(6, dtype=torch.int32, device=dev)
        self.out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        self.x = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        self.side = torch.cuda.Stream(dev)
        self.per = (T + NC - 1) // NC
        torch.cuda.synchronize()
        dist.barrier()

    # views: flag 0 = data flag (peer writes it), flag 1 = ready flag (pull), flag 2 = local pull flag
    def flag(self, buf, i):
        return buf[4 * i:4 * i + 4].view(torch.int32)

    def staging(self, buf):
        return buf[256:256 + self.data_bytes]

    def outbox(self, buf):
        return buf[256 + self.data_bytes:256 + 2 * self.data_bytes]

    def rows(self, region, c):
        lo, hi = c * self.per * self.row_bytes, min((c + 1) * self.per, T) * self.row_bytes
        return region[lo:hi]

    def call(self):
        name, xb = self.name, self.x.view(torch.uint8).view(-1)
        cur = torch.cuda.current_stream()
        if name in ("ce-fork-kflag", "ce-fork-ceflag"):
            self.side.wait_stream(cur)
            with torch.cuda.stream(self.side):
                for c in range(NC):
                    self.rows(self.staging(self.remote), c).copy_(self.rows(xb, c))
                    if name == "ce-fork-kflag":
                        _signal_kernel[(1,)](self.flag(self.remote, 0), 1)
                    else:
                        _set_level_kernel[(1,)](self.ctr, self.words[c:], c, NC=NC)
                        self.flag(self.remote, 0).copy_(self.words[c:c + 1])
            self._recv(self.flag(self.symm, 0), self.staging(self.symm))
            cur.wait_stream(self.side)
        elif name == "ce-same-kflag":
            for c in range(NC):
                self.rows(self.staging(self.remote), c).copy_(self.rows(xb, c))
                _signal_kernel[(1,)](self.flag(self.remote, 0), 1)
            self._recv(self.flag(self.symm, 0), self.staging(self.symm))
        elif name == "pull":
            self.outbox(self.symm).copy_(xb)
            _signal_kernel[(1,)](self.flag(self.remote, 1), NC)  # "my outbox holds this call's rows"
            _wait_level_kernel[(1,)](self.flag(self.symm, 1), self.ctr, NC, NC, self.err, TIMEOUT_NS)
            for c in range(NC):
                self.rows(self.staging(self.symm), c).copy_(self.rows(self.outbox(self.remote), c))
                _signal_kernel[(1,)](self.flag(self.symm, 2), 1)
            self._recv(self.flag(self.symm, 2), self.staging(self.symm))
        elif name == "sm-push":
            _push_kernel[(NC,)](self.x.view(torch.int32), self.staging(self.remote).view(torch.int32),
                                self.flag(self.remote, 0), self.per, T, H // 2, NC=NC, BLOCK=1024, num_warps=8)
            self._recv(self.flag(self.symm, 0), self.staging(self.symm))
        _bump_kernel[(1,)](self.ctr)
        return self.out

    def _recv(self, flag, staging):
        _recv_kernel[(NC,)](flag, self.ctr, staging.view(torch.int32), self.out.view(torch.int32), self.per, T,
                            H // 2, self.err, TIMEOUT_NS, NC=NC, BLOCK=1024, num_warps=8)


def _input(rank: int, it: int, dev) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(1000 * it + rank)
    return torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)


def _run(v: _Variant, mode: str, first_it: int) -> tuple[int, list[int], str, float]:
    """``CALLS`` calls (eager, or replays of one captured call); bad calls, sample rows, error, us."""
    dev = v.dev
    step = v.call
    if mode == "graph":
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            v.call()

        def step():
            g.replay()
            return v.out
    bad, rows, times = 0, [], []
    for it in range(first_it, first_it + CALLS):
        v.x.copy_(_input(v.me, it, dev))
        expect = _input(v.peer, it, dev)
        torch.cuda.synchronize()
        dist.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = step()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
        if int(v.err[0]) != 0:
            return bad, rows, f"timeout (flag {int(v.err[2])} < {int(v.err[3])})", 0.0
        diff = (out.view(torch.int16) != expect.view(torch.int16)).any(1).nonzero().flatten().tolist()
        if diff:
            bad += 1
            rows = rows or diff[:8]
    dist.barrier()
    return bad, rows, "", statistics.median(times)


def _rank(ctx):
    out = []
    for name in os.environ.get("PROBE_VARIANTS", ",".join(VARIANTS)).split(","):
        try:
            v = _Variant(name, ctx.group, ctx.device)
            v.x.copy_(_input(v.me, 0, v.dev))
            v.call()  # compile, warm up
            torch.cuda.synchronize()
            dist.barrier()
            for mode, first in (("eager", 1), ("graph", 100)):
                bad, rows, err, us = _run(v, mode, first)
                out.append((name, mode, bad, rows, err, us))
        except Exception as e:  # noqa: BLE001 - one variant's failure must not hide the others
            out.append((name, "-", -1, [], f"{type(e).__name__}: {str(e)[:120]}", 0.0))
            torch.cuda.synchronize()
            dist.barrier()
    return out


def main() -> None:
    res = parallel_launch(2, _rank, backend="nccl", timeout_s=240)
    print(f"T={T} rows of H={H} bf16 ({T * H * 2 / 2**20:.1f} MiB) in {NC} chunks, {CALLS} calls per mode")
    print(f"{'variant':16} {'mode':6} {'bad calls (rank 0/1)':22} {'first bad rows':28} {'median us':>9}  error")
    for a, b in zip(*res):
        print(f"{a[0]:16} {a[1]:6} {f'{a[2]}/{b[2]} of {CALLS}':22} {str(a[3] or b[3]):28} "
              f"{max(a[5], b[5]):9.1f}  {a[4] or b[4]}")


if __name__ == "__main__":
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    main()
