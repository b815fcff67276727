#!/usr/bin/env bash
# One call on the device machine: GPU test tier + benchmark; a short table last.
# Usage (device tool): bash scripts/gpu_check.sh [tests|tier2|probe|bench|all]
#   tests: tier 3 (tests/gpu); tier2: tests/dist on NCCL with CUDA tensors; bench: epcomm bench
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
OUT="${OUT:-/tmp/epcomm-out}"; mkdir -p "$OUT"
what="${1:-all}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
rc=0
if [[ "$what" == tests || "$what" == all ]]; then
  timeout 560 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -40 || rc=1
fi
if [[ "$what" == probe ]]; then
  timeout 300 python3 scripts/ht_probe.py 2>&1 | tee "$OUT/probe.log" | tail -20 || rc=1
fi
if [[ "$what" == tier2 || "$what" == all ]]; then
  EPCOMM_TEST_TRANSPORT=nccl timeout ${TIER2_TIMEOUT:-300} python3 -m pytest -q -rfE -p no:cacheprovider tests/dist \
    2>&1 | tee "$OUT/tier2-nccl.log" | tail -25 || rc=1
fi
if [[ "$what" == bench || "$what" == all ]]; then
  timeout 500 python3 -m epcomm bench ${BENCH_ARGS:-} --out "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.log" | tail -30 || rc=1
fi
exit $rc
