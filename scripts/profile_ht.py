"""Where does an eager high-throughput call spend its time? torch.profiler over a few nvlink
dispatch + combine calls (DeepSeek-V3 shape, 2 ranks); prints rank 0's top CPU and CUDA entries.
Run on the device machine: ``PYTHONPATH=src python3 scripts/profile_ht.py`` (gpu_check.sh profile);
``PROFILE_GRAPH=1``: the kernels of CUDA-graph replays of a worst-mode dispatch + combine;
``PROFILE_WORLD=1``: one rank (a single GPU: the local kernels' times without the link)."""
import os
import sys

import torch

from epcomm import Buffer
from epcomm.testing import gpu_cases as G
from epcomm.testing.inputs import Case
from epcomm.testing.launcher import parallel_launch


def main(ctx, tokens, out_dir):
    Buffer.set_num_sms(24)
    _, fast = G.make_buffers(ctx.group, num_nvl_bytes=2 << 30)
    case = Case(num_ranks=ctx.world_size, tokens=(tokens,) * ctx.world_size, hidden=7168, num_topk=8,
                num_experts=256, seed=1)
    xin, x, topk, w = G.device_inputs(case, ctx.rank, fast.device)
    pr, _, pe, ir, _ = fast.get_dispatch_layout(topk, 256)

    worst = tokens * ctx.world_size if os.environ.get("PROFILE_GRAPH") else 0

    def call():
        o = fast.dispatch(xin, num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe,
                          topk_idx=topk, topk_weights=w, num_worst_tokens=worst)
        fast.combine(o[0], o[4])

    step = call
    if worst:  # PROFILE_GRAPH=1: replays of one captured worst-mode dispatch + combine (kernels inside)
        step = G.capture(call)[0].replay

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    torch.distributed.barrier()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    if ctx.rank == 0:
        prof.export_chrome_trace(os.path.join(out_dir, "ht_trace.json"))
        return (prof.key_averages().table(sort_by="cpu_time_total", row_limit=25),
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    return None


if __name__ == "__main__":
    out = os.environ.get("OUT", "/tmp")
    res = parallel_launch(int(os.environ.get("PROFILE_WORLD", "2")), main, int(sys.argv[1]) if len(sys.argv) > 1 else 4096, out, backend="nccl",
                          timeout_s=240)
    print(res[0][0])
    print(res[0][1])
