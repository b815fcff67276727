"""The high-throughput combine's receive kernel (``kernels/ht.py _reduce_kernel``) alone on ONE GPU, as
it runs on a rank of an R-rank group once the peers' rows have arrived: every row it reads is local
(its own expert outputs and the staging the peers pushed into), so a single GPU times it as the
R-rank backend runs it. The peers' data flags are preset, so no wait blocks; tile variants of
``TUNE`` (reduce_tb, reduce_block, reduce_stages, reduce_warps) side by side.

DeepSeek-V3 shape by default: 4096 tokens, hidden 7168, top-8, every token with a row from each of
``R`` ranks (top-8 of 256 experts reaches both of 2 ranks for >99 % of tokens).
Run on the device machine: ``PYTHONPATH=src python3 scripts/kernel_bench.py [R] [sms]``
(``KB_VARIANTS=tb,block,stages,warps;...`` picks variants)."""
import os
import sys

if os.environ.get("KB_DEVICE") == "cpu":
    import epcomm.testing.interp  # noqa: F401 - Triton's interpreter, before triton loads

import torch

from epcomm.backends.nvlink_params import NC, TUNE, _pow2
from epcomm.kernels import ht

T, H, K = int(os.environ.get("KB_T", "4096")), int(os.environ.get("KB_H", "7168")), 8
# KB_DEVICE=cpu (the Triton interpreter; small KB_T, KB_H): a check of this script without a GPU
DEVICE = torch.device(os.environ.get("KB_DEVICE", "cuda"))
DEFAULT_VARIANTS = [
    (TUNE["reduce_tb"], TUNE["reduce_block"], TUNE["reduce_stages"], TUNE["reduce_warps"]),
    (16, 1024, 3, 16), (16, 1024, 1, 16), (16, 2048, 1, 16), (8, 2048, 1, 16), (8, 2048, 1, 8),
    (8, 1024, 3, 8), (32, 1024, 1, 16), (4, 4096, 1, 8), (8, 4096, 1, 16), (16, 512, 1, 16),
    (16, 512, 2, 16), (8, 512, 3, 16), (8, 512, 2, 8), (16, 256, 3, 16),
]


def run(r_, sms, variants, iters=20):
    dev = DEVICE
    me = 0
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(r_ * T, H, device=dev, generator=gen).to(torch.bfloat16)  # my received rows (all ranks')
    w = torch.rand(r_ * T, K, device=dev, generator=gen)
    stage_x = torch.randn(r_, T, H, device=dev, generator=gen).to(torch.bfloat16)  # slot j: rank j's rows for me
    stage_w = torch.rand(r_, T, K, device=dev, generator=gen)
    # rpm = cumsum over source ranks of the counts (every rank sends all T tokens everywhere)
    # my block in every rank's received rows comes first (I am rank 0): token t is row t there
    send_head = torch.arange(T, device=dev, dtype=torch.int32)[:, None].expand(T, r_).contiguous()
    rpm = (torch.arange(1, r_ + 1, device=dev, dtype=torch.int32)[:, None] * T).expand(r_, r_).contiguous()
    flags = torch.zeros(64, dtype=torch.int32, device=dev)
    ptr_table = torch.tensor([flags.data_ptr()] * r_, dtype=torch.int64, device=dev)
    ctr = torch.zeros(4, dtype=torch.int32, device=dev)
    tickets = torch.zeros(8, dtype=torch.int32, device=dev)
    err = torch.zeros(8, dtype=torch.int32, device=dev)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    out_w = torch.empty(T, K, dtype=torch.float32, device=dev)
    # expected: Σ_j rows in float32, rank order (j = me from x, others from staging)
    ref = x[:T].float() + sum(stage_x[j].float() for j in range(r_) if j != me)
    rows = []
    for tb, block, stages, warps in variants:
        flags[ht.CDATA.value * r_:(ht.CDATA.value + 1) * r_] = 1 << 24  # every chunk has arrived
        ctr.zero_()

        def launch():
            ht._reduce_kernel[(max(1, min(sms, (T + tb - 1) // tb)),)](
                x, H, T, r_, me, send_head, rpm, w, K, x.shape[0], stage_x, T * H, stage_w, T * K,
                out, out, out, out_w, ptr_table, 0, ctr, tickets, err, 10 ** 10,
                HAS_W=True, NUM_BIAS=0, NC=NC, TB=tb, BLOCK=block, R_POW2=_pow2(r_), K_POW2=_pow2(K),
                HAS_TIMER=dev.type == "cuda", STAGES=stages, num_warps=warps)
        try:
            launch()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a variant that does not fit (shared memory, registers)
            rows.append((tb, block, stages, warps, f"{type(e).__name__}: {str(e)[:80]}"))
            continue
        # one bf16 rounding of the float32 sum (an ulp under the interpreter, which truncates)
        ok = bool(((out.float() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-6).all()) and int(err[0]) == 0
        if dev.type == "cpu":
            rows.append((tb, block, stages, warps, "ok" if ok else "WRONG"))
            continue
        ts = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                launch()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / iters)
        us = sorted(ts)[len(ts) // 2]
        gbs = (r_ + 1) * T * H * 2 / us / 1e3
        rows.append((tb, block, stages, warps, f"{us:8.1f} us {gbs:7.0f} GB/s {'ok' if ok else 'WRONG'}"))
    return rows


if __name__ == "__main__":
    r_ = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    sms = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    variants = DEFAULT_VARIANTS
    if os.environ.get("KB_VARIANTS"):
        variants = [tuple(int(v) for v in s.split(",")) for s in os.environ["KB_VARIANTS"].split(";")]
    print(f"_reduce_kernel R={r_} programs<={sms} T={T} H={H} K={K} (rows read {r_}x, written 1x, bf16)")
    for tb, block, stages, warps, res in run(r_, sms, variants):
        print(f"  tb={tb:3d} block={block:5d} stages={stages} warps={warps:2d}: {res}")
