"""What the tier-3 checks share: a call captured into a CUDA graph, and a long check's progress on stderr."""

from __future__ import annotations

import logging
import sys

import torch


def capture(fn, warmup: int = 1):
    """Run ``fn`` ``warmup`` times on a side stream (kernels compile outside the capture), wait for
    the device and every rank, then capture one more call in a CUDA graph. Returns ``(graph, what the
    captured call returned)``; ``graph.replay()`` reruns it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    torch.distributed.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def _progress_log() -> logging.Logger:
    lg = logging.getLogger("epcomm.testing.progress")
    if not lg.handlers:  # rank processes configure no logging: their stderr is what a failing test shows
        lg.addHandler(logging.StreamHandler(sys.stderr))
        lg.setLevel(logging.INFO)
        lg.propagate = False
    return lg


def progress(rank: int, msg: str) -> None:
    """A step of a long check, on stderr (the launcher's error shows it when a rank hangs)."""
    _progress_log().info("[rank %d] %s", rank, msg)
