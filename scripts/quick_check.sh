#!/usr/bin/env bash
# A short device call when little device time is left: the HT graph test (SM push under capture),
# the DSv3 HT and LL benchmarks (24 SMs; NCCL reference in the same run), then tier 3's HT cases with
# EPCOMM_HT_TRANSFER=sm. Each step has its own timeout and writes under $OUT as it goes.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
OUT="${OUT:-/tmp/epcomm-out}"; mkdir -p "$OUT"
rc=0
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_nvlink_ht.py::test_nvlink_high_throughput_graph \
  2>&1 | tee "$OUT/graph.log" | grep -E "AssertionError|graph replay|passed|failed" | grep -v "^\[rank" | head -5 || rc=1
timeout 90 python3 -m epcomm bench --cases ht-dsv3 --mode ht --num-sms 24 --iters 20 --warmup 3 \
  --out "$OUT/ht24.jsonl" > "$OUT/ht24.log" 2>&1 || rc=1
timeout 80 python3 -m epcomm bench --cases ll-dsv3,ll-dsv3-288 --mode ll --tokens 1,128 --iters 30 --warmup 5 \
  --out "$OUT/ll.jsonl" > "$OUT/ll.log" 2>&1 || rc=1
timeout 90 python3 -m pytest -q -p no:cacheprovider \
  "tests/gpu/test_nvlink_ht.py::test_nvlink_high_throughput_cases[sm]" 2>&1 | tail -3 || rc=1
tail -12 "$OUT/ht24.log"; grep -E "^ll|^case" "$OUT/ll.log" | grep -v reference | head -24
exit $rc
