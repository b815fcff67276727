"""The copy-engine ceiling: ``peer.copy_(src)`` between two GPUs, both directions at once.

This is the practical link ceiling that every row's link bandwidth is compared with, measured in the
same run on the same GPUs (no figure from another machine or day is assumed). It runs in its own
short-lived process (through the common launcher, a 1-rank gloo group) so the benchmark ranks never
hold a second GPU's context.
"""

from __future__ import annotations

import statistics

import torch

from ..testing.launcher import parallel_launch


def peer_copy_gbps(nbytes: int = 256 << 20, reps: int = 5, warmup: int = 2, devices: tuple[int, int] = (0, 1)) -> float:
    """Median GB/s per direction of ``nbytes`` copies ``a -> b`` and ``b -> a`` issued together.

    Each copy runs on its own stream of its source device; the destination side of each copy is
    pointed at an otherwise idle stream, because ``copy_`` makes the destination's current stream
    wait for the copy, and that must not serialise the opposite direction behind it.
    """
    a, b = (torch.device("cuda", d) for d in devices)
    n = nbytes // 2
    src_a = torch.randn(n, device=a, dtype=torch.bfloat16)
    src_b = torch.randn(n, device=b, dtype=torch.bfloat16)
    dst_b = torch.empty(n, device=b, dtype=torch.bfloat16)
    dst_a = torch.empty(n, device=a, dtype=torch.bfloat16)
    s_a, idle_a = torch.cuda.Stream(a), torch.cuda.Stream(a)
    s_b, idle_b = torch.cuda.Stream(b), torch.cuda.Stream(b)
    samples = []
    for i in range(warmup + reps):
        torch.cuda.synchronize(a)
        torch.cuda.synchronize(b)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        with torch.cuda.stream(s_a), torch.cuda.stream(idle_b):
            ev[0].record(s_a)
            dst_b.copy_(src_a, non_blocking=True)
            ev[1].record(s_a)
        with torch.cuda.stream(s_b), torch.cuda.stream(idle_a):
            ev[2].record(s_b)
            dst_a.copy_(src_b, non_blocking=True)
            ev[3].record(s_b)
        ev[1].synchronize()
        ev[3].synchronize()
        if i >= warmup:
            for start, end in ((ev[0], ev[1]), (ev[2], ev[3])):
                samples.append(2 * n / (start.elapsed_time(end) / 1e3) / 1e9)
    if not torch.equal(dst_b.cpu(), src_a.cpu()):
        raise RuntimeError("peer copy produced different bytes: the copy-engine measurement is invalid")
    return statistics.median(samples)


def _peer_worker(ctx, nbytes: int, reps: int) -> float:
    return peer_copy_gbps(nbytes, reps)


def measure_copy_engine(nbytes: int = 256 << 20, reps: int = 5, timeout_s: float = 180.0) -> float | None:
    """GB/s per direction between GPUs 0 and 1, or ``None`` with fewer than two GPUs."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    return parallel_launch(1, _peer_worker, nbytes, reps, backend="gloo", timeout_s=timeout_s)[0]
