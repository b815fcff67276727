"""Tier 2: a process whose last act is an epcomm call on gloo exits cleanly.

gloo runs a collective on a worker thread of the process group, which drops its reference to the
operation a moment after ``wait()`` returned. When that reference was the last, the operation's tensors
were freed on the worker thread, which must take the GIL; at interpreter exit that thread is killed
mid-destructor and the process aborts with "terminate called without an active exception" (SIGABRT),
although every call succeeded. The README's example (which ends right after ``combine``) aborted so in
about one run of five under ``torchrun`` (``OMP_NUM_THREADS=1``). epcomm now keeps each finished gloo
operation referenced from Python until it is ``_SETTLE_S`` old, and waits that long at exit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist

from epcomm.backends import deadline

RANK = r'''
import sys
import torch, torch.distributed as dist
import epcomm as deep_ep

rank, init = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
buf = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20)
torch.manual_seed(rank)
T, H, K, E = 64, 512, 4, 16
x = torch.randn(T, H).to(torch.bfloat16)
topk_idx = torch.randint(0, E, (T, K))
per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                          num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                          topk_weights=torch.rand(T, K))
out, _, _ = buf.combine(recv_x, handle)
print("done", tuple(out.shape), flush=True)
'''  # no destroy: the interpreter's exit follows the combine at once, as in the README's example


def test_a_finished_gloo_operation_is_held_from_python(tmp_path):
    """The mechanism: after ``deadline.wait``, the work object is referenced from ``_RETIRED``, so the
    worker thread's reference is never the last."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        send, recv = torch.arange(8.0), torch.empty(8)
        work = deadline.issue_all_to_all(group, recv, send, [8], [8], 10.0)
        deadline.wait(work, group, torch.device("cpu"), 0, "test/a2a", 10.0)
        assert torch.equal(recv, send)
        assert any(w is work for _, w in deadline._RETIRED), "the finished gloo work is not held"
    finally:
        dist.destroy_process_group()


def test_processes_ending_right_after_combine_exit_cleanly(tmp_path):
    """Six pairs of processes, each ending right after a dispatch + combine with no teardown, under
    ``OMP_NUM_THREADS=1`` as torchrun sets it: every process exits 0 (before the fix, 3 of 15 pairs had a
    rank abort)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for run in range(6):
        init = str(tmp_path / f"rdv{run}")
        procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), init], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        for r, (p, (out, err)) in enumerate(zip(procs, outs)):
            assert p.returncode == 0, f"run {run} rank {r} exited {p.returncode}:\n{err[-2000:]}"
            assert "done (64, 512)" in out, f"run {run} rank {r}: {out!r}"
