"""Quick GPU timing of the high-throughput path (nvlink vs reference on NCCL), DeepSeek-V3 shape.
Superseded by `epcomm bench` for recorded figures; kept for kernel work."""
import sys

import torch

from epcomm.testing import gpu_cases as G
from epcomm.testing.inputs import Case
from epcomm.testing.launcher import parallel_launch


def _time(fn, iters=30, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.distributed.barrier()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.distributed.barrier()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    ts.sort()
    return ts[len(ts) // 2]


def main(ctx, tokens, sms):
    from epcomm import Buffer
    Buffer.set_num_sms(sms)
    ref, fast = G.make_buffers(ctx.group, num_nvl_bytes=2 << 30)
    case = Case(num_ranks=ctx.world_size, tokens=(tokens,) * ctx.world_size, hidden=7168, num_topk=8,
                num_experts=256, seed=1)
    rows = {}
    for fp8 in (False, True):
        xin, x, topk, w = G.device_inputs(case, ctx.rank, fast.device, fp8)
        for name, buf in (("ref", ref), ("nvlink", fast)):
            pr, _, pe, ir, _ = buf.get_dispatch_layout(topk, 256)
            def d():
                return buf.dispatch(xin, num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe,
                                    topk_idx=topk, topk_weights=w)
            rows[f"{name} dispatch {'fp8' if fp8 else 'bf16'}"] = _time(d)
            if not fp8:
                o = d()
                y = o[0]
                rows[f"{name} combine bf16"] = _time(lambda: buf.combine(y, o[4]))
                rows[f"{name} cached dispatch bf16"] = _time(lambda: buf.dispatch(xin, handle=o[4]))
    return rows


if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    for sms in (24, 32):
        res = parallel_launch(2, main, tokens, sms, backend="nccl", timeout_s=300)
        for k in res[0]:
            print(f"sms={sms} {k:28s} " + " ".join(f"{r[k]:8.1f}us" for r in res))
