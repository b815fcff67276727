#!/usr/bin/env bash
# One call on a GPU machine (the device tool runs it from the repository root; output under $OUT).
# Usage: bash scripts/gpu_check.sh MODE [ARG]
#   tests           tier 3 (tests/gpu, one rank per GPU) then tier 2 on NCCL (tests/dist with
#                   EPCOMM_TEST_TRANSPORT=nccl); needs 2+ GPUs (~6 min)
#   bench           epcomm bench on the DeepSeek-V3 cases (ht-dsv3, ll-dsv3, ll-dsv3-288), 24 SMs,
#                   the NCCL reference and the copy-engine ceiling in the same run (~3 min)
#   figures         the figures BENCHMARKS.md quotes, one JSONL per step under
#                   $OUT/benchmarks/<UTC date>/ (commit them as benchmarks/<date>/): DSv3 high-throughput
#                   full and cached, DSv3 low-latency at 1 and 128 tokens, the token sweep with its
#                   plots (~8 min)
#   profile         epcomm bench --profile on the DeepSeek-V3 cases: per operation, a host-path (cProfile)
#                   and a torch.profiler table, under $OUT/profile/
#   shared [WORLD]  tier 3 with WORLD ranks (default 2) time-sharing the GPUs (EPCOMM_TEST_SHARE_GPU=1):
#                   for single-GPU kinds; correctness of the multi-rank paths only, no timing (~5 min at 2)
#   shared-nvshmem [WORLD]  the internode tier 3 with WORLD ranks (2 or 4) on one GPU: NVSHMEM takes
#                   several PEs per GPU only under MPS (else "not supported with limited MPG"), so this mode
#                   starts a private MPS daemon (its own pipe directory) and stops it after, each process at
#                   CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/WORLD (two take 50, four 25).
#                   WORLD 2: tests/gpu/test_internode_nvshmem.py, two virtual nodes of one (~9 min; with
#                   EPCOMM_VERIFY_LAUNCH=1 more than the 560 s cap: split it, PYTEST_ARGS="-k high_throughput"
#                   then PYTEST_ARGS="-k 'not high_throughput'"). WORLD 4: tests/gpu/test_internode_2x2.py,
#                   two nodes of two (EPCOMM_GPUS_PER_NODE=2: the forwarding path) and four nodes of one;
#                   ~13 min: split it over calls or jobs (scripts/gpu_jobs.sh) (PYTEST_ARGS="-k 2-nodes-of-2", "-k 4-nodes-of-1", "-k low_latency").
#                   TIER3=<file> runs that tier-3 file instead under the same daemon (e.g. TIER3=tests/gpu/
#                   test_elastic_extras.py: the experimental calls on nvlink, the reference and internode)
#   bench-nvshmem [WORLD]  epcomm bench --backend internode, then --backend nvlink, WORLD ranks (2 or 4)
#                   on one GPU under the same private MPS daemon (virtual nodes: of one GPU at 2, of two at 4):
#                   ht-dsv3 and ll-dsv3-288, 24 SMs, 12 iterations; JSONL in $OUT/bench-mps-<backend>.jsonl
#                   (bench-mps4-<backend>.jsonl at 4) (~5 min at 2); BENCH_BACKENDS and BENCH_CASES narrow it,
#                   BENCH_ARGS adds to it (e.g. an --ab run), BENCH_TIMEOUT caps each bench (default 270 s)
#   soak [WORLD]    scripts/soak.py with WORLD ranks (2 to 8, default 2) on one GPU under the same private MPS
#                   daemon (EPCOMM_TEST_SHARE_GPU=1, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/WORLD): SOAK_CALLS calls
#                   (default 10000) of every kind, each checked against the reference, GPU and host memory and the
#                   plan caches watched; one line a rank, the report and memory series in $OUT/soak.json, the log
#                   in $OUT/soak.log. SOAK_ARGS adds options (e.g. "--max-tokens 512"); SOAK_TIMEOUT (default 570 s)
#                   caps it, the ranks stopped 30 s before with their stacks
#   ab BASE_DIR     epcomm bench --ab: the tree in BASE_DIR (a directory with src/epcomm, shipped with the working
#                   tree: e.g. `mkdir -p ab-base && git archive <sha> src | tar -x -C ab-base` before the call,
#                   untracked, not ignored) against this tree, alternated run by run for AB_ROUNDS rounds (default
#                   3); BENCH_ARGS picks the cases (default --cases ll-dsv3 --tokens 1,128; "--api v2 --cases ht-dsv3"
#                   for ElasticBuffer's rows, each layout and sync apart); AB_BASE_COMMIT names
#                   the base tree's commit. Rows in $OUT/ab.jsonl, runs and logs in $OUT/ab-runs/, summary printed
#                   and in $OUT/ab-summary.jsonl
#   deepep-extras CHECKOUT [WORLD]  DeepEP V2's own scripts of the experimental calls against epcomm (python -m
#                   epcomm.testing.deepep_v2; nothing of DeepEP is copied here), WORLD ranks (2 or 4, default 2) on one
#                   GPU under a private MPS daemon (as shared-nvshmem), each to its end with its timing part:
#                   tests/elastic/test_engram.py (BF16, then --use-fp8), test_pp.py, test_agrs.py, test_barrier.py.
#                   CHECKOUT: a DeepEP tree (read only) with tests/elastic/ and deep_ep/utils/ (its test helpers), e.g.
#                   .deepep/v2 carried beside the tree. DEEPEP_TESTS narrows it (default "engram engram-fp8 pp agrs
#                   barrier", each capped at DEEPEP_TIMEOUT s, default 240); logs in $OUT/deepep-<test>-w<WORLD>.log. Memory: test_pp allocates 16 GiB of zeros a
#                   rank in its timing part besides its 128 tensors of 56 MiB: at WORLD 4 run it on nvidia-h200, or on
#                   an H100 with DEEPEP_PP_ARGS="--num-sends 16" (its stress test's sends, 16 of them; the rest as given)
#                   (~3 min at 2 ranks on an H100, all five)
#   anchor DEEPEP [WORLD]  scripts/deepep_eager.py --share-gpu (DeepEP V1's eager high-throughput calls, fresh and
#                   cached dispatch and combine, DSv3 shapes, 24 SMs) on epcomm (EPCOMM_AS_DEEP_EP=1) and on DeepEP V1
#                   (DEEPEP: a directory with its built deep_ep package, put first on PYTHONPATH; e.g. the output of
#                   benchmarks/anchors/deepep-v1-build/build.sh carried beside the tree), one after the other, for
#                   ANCHOR_ROUNDS rounds (default 3), WORLD ranks (default 2) on one GPU under a private MPS daemon.
#                   One JSON row a call and run in $OUT/anchor.jsonl (label epcomm-rN / deepep-rN), logs in
#                   $OUT/anchor.log; ANCHOR_TIMEOUT caps each run (default 150 s)
# EPCOMM_MPS_RUNNING=1: an MPS daemon is already up (CUDA_MPS_PIPE_DIRECTORY set): use it, neither start nor stop one.
# Provenance: the GPU machine's copy of the tree has no .git, so every bench row would say git_sha
# "unknown". The caller passes the commit of the tree it ships, expanded on ITS machine (the command
# string must carry the literal sha; $(git ...) would run on the GPU machine and fail):
#   EPCOMM_COMMIT=<git rev-parse HEAD> EPCOMM_COMMIT_DIRTY=<1 if `git status --porcelain -- src/epcomm`
#   prints anything, else 0> bash scripts/gpu_check.sh bench
# e.g. the command composed locally:
#   echo "EPCOMM_COMMIT=$(git rev-parse HEAD) EPCOMM_COMMIT_DIRTY=$(git status --porcelain -- src/epcomm \
#         | grep -q . && echo 1 || echo 0) bash scripts/gpu_check.sh bench"
# Every row then records them (env.git_sha, env.git_dirty, env.commit_source = "EPCOMM_COMMIT").
# Every mode prints the GPUs and versions first, packs everything under $OUT into $OUT/0-out.tgz last (the device
# tool returns at most 8 files), and exits non-zero if a step failed.
# Extra arguments: PYTEST_ARGS (tests, shared: e.g. "-k graph"), BENCH_ARGS (bench, profile: e.g.
# "--mode ll"), EPCOMM_TUNE / EPCOMM_HT_TRANSFER to measure a variant (recorded in every JSONL row).
set -uo pipefail
# NVLink multicast (NVLS) stays off on the lent machines
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
OUT="${OUT:-/tmp/epcomm-out}"; mkdir -p "$OUT"
mode="${1:-}"
case "$mode" in tests|bench|figures|profile|shared|shared-nvshmem|bench-nvshmem|soak|ab|deepep-extras|anchor) ;;
  *) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2 ;;
esac
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
if [[ -n "${EPCOMM_COMMIT:-}" ]]; then
  export EPCOMM_COMMIT EPCOMM_COMMIT_DIRTY="${EPCOMM_COMMIT_DIRTY:-}"
  echo "tree: EPCOMM_COMMIT=$EPCOMM_COMMIT EPCOMM_COMMIT_DIRTY=${EPCOMM_COMMIT_DIRTY:-unknown}" | tee "$OUT/commit.txt"
elif ! git rev-parse HEAD >/dev/null 2>&1; then
  echo "WARNING: no .git here and EPCOMM_COMMIT unset: rows will say git_sha \"unknown\" (see the header)"
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'gpus', torch.cuda.device_count())"
rc=0
pytest=(python3 -m pytest -q -rfE -p no:cacheprovider --durations=5)
bench=(python3 -m epcomm bench --no-progress)

if [[ "$mode" == tests ]]; then
  timeout 330 "${pytest[@]}" tests/gpu ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tier3.log" | tail -30 || rc=1
  EPCOMM_TEST_TRANSPORT=nccl timeout 240 "${pytest[@]}" tests/dist ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/tier2-nccl.log" | tail -20 || rc=1
fi

if [[ "$mode" == shared ]]; then
  export EPCOMM_TEST_SHARE_GPU=1 EPCOMM_TEST_WORLD="${2:-2}"
  timeout 560 "${pytest[@]}" tests/gpu ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tier3-shared$EPCOMM_TEST_WORLD.log" \
    | tail -30 || rc=1
fi

if [[ "$mode" == anchor ]]; then
  deepep="${2:?usage: bash scripts/gpu_check.sh anchor DEEPEP [WORLD] (a directory with the built deep_ep of DeepEP V1)}"
  [[ -d "$deepep/deep_ep" ]] || { echo "$deepep must hold DeepEP's deep_ep package, built"; exit 2; }
  deepep=$(cd "$deepep" && pwd)
  set -- "$1" "${3:-2}"
fi

if [[ "$mode" == deepep-extras ]]; then
  checkout="${2:?usage: bash scripts/gpu_check.sh deepep-extras CHECKOUT [WORLD] (a DeepEP tree)}"
  [[ -d "$checkout/tests/elastic" && -d "$checkout/deep_ep/utils" ]] || {
    echo "$checkout must hold tests/elastic/ and deep_ep/utils/ of DeepEP"; exit 2; }
  set -- "$1" "${3:-2}"
fi

if [[ "$mode" == shared-nvshmem || "$mode" == bench-nvshmem || "$mode" == soak || "$mode" == deepep-extras \
      || "$mode" == anchor ]]; then
  world="${2:-2}"
  if [[ "$mode" == soak ]]; then
    [[ "$world" =~ ^[2-8]$ ]] || { echo "$mode takes WORLD 2 to 8, got $world"; exit 2; }
  else
    [[ "$world" == 2 || "$world" == 4 ]] || { echo "$mode takes WORLD 2 or 4, got $world"; exit 2; }
  fi
  export EPCOMM_TEST_SHARE_GPU=1 EPCOMM_TEST_WORLD=$world CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / world))
  if [[ "${EPCOMM_MPS_RUNNING:-}" != 1 ]]; then  # scripts/gpu_jobs.sh starts one daemon for every job
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/epcomm-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/epcomm-mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "could not start an MPS daemon"; exit 1; }
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
  fi
fi

if [[ "$mode" == deepep-extras ]]; then
  unset EPCOMM_GPUS_PER_NODE  # one node: the nvlink backend
  for t in ${DEEPEP_TESTS:-engram engram-fp8 pp agrs barrier}; do
    case "$t" in
      engram) script=test_engram.py args=() ;;
      engram-fp8) script=test_engram.py args=(--use-fp8) ;;
      pp) script=test_pp.py args=(${DEEPEP_PP_ARGS:-}) ;;
      agrs) script=test_agrs.py args=() ;;
      barrier) script=test_barrier.py args=() ;;
      *) echo "unknown DeepEP test $t"; rc=1; continue ;;
    esac
    log="$OUT/deepep-$t-w$world.log"
    timeout ${DEEPEP_TIMEOUT:-240} python3 -m epcomm.testing.deepep_v2 "$checkout" "tests/elastic/$script" --num-processes "$world" \
      "${args[@]}" > "$log" 2>&1
    code=$?
    echo "DeepEP $script ${args[*]} at $world ranks: rc $code"
    grep -v "^\[testing\]" "$log" | tail -12
    [[ $code == 0 ]] || rc=1
  done
fi

if [[ "$mode" == anchor ]]; then
  for r in $(seq 1 "${ANCHOR_ROUNDS:-3}"); do
    EPCOMM_AS_DEEP_EP=1 timeout "${ANCHOR_TIMEOUT:-150}" python3 scripts/deepep_eager.py --share-gpu --ranks "$world" \
      --label "epcomm-r$r" --json "$OUT/anchor.jsonl" 2>&1 | tee -a "$OUT/anchor.log" | grep " eager " || rc=1
    PYTHONPATH="$deepep:${PYTHONPATH:-}" EPCOMM_AS_DEEP_EP=0 timeout "${ANCHOR_TIMEOUT:-150}" python3 \
      scripts/deepep_eager.py --share-gpu --ranks "$world" --label "deepep-r$r" --json "$OUT/anchor.jsonl" 2>&1 \
      | tee -a "$OUT/anchor.log" | grep " eager " || rc=1
  done
fi

if [[ "$mode" == bench-nvshmem ]]; then
  tag=mps; [[ "$world" == 4 ]] && tag=mps4
  for b in ${BENCH_BACKENDS:-internode nvlink}; do
    EPCOMM_GPUS_PER_NODE=$((world / 2)) timeout ${BENCH_TIMEOUT:-270} "${bench[@]}" --world-size $world --backend $b --cases ${BENCH_CASES:-ht-dsv3,ll-dsv3-288} --num-sms 24 \
      --iters 12 ${BENCH_ARGS:-} --out "$OUT/bench-$tag-$b.jsonl" 2>&1 | tee "$OUT/bench-$tag-$b.log" \
      | tail -25 || rc=1
  done
fi

if [[ "$mode" == soak ]]; then
  limit="${SOAK_TIMEOUT:-570}"
  timeout "$limit" python3 scripts/soak.py --world "$world" --calls "${SOAK_CALLS:-10000}" --timeout $((limit - 30)) \
    --json "$OUT/soak.json" ${SOAK_ARGS:-} 2>&1 | tee "$OUT/soak.log" | tail -25 || rc=1
fi

if [[ "$mode" == shared-nvshmem ]]; then
  tier3=tests/gpu/test_internode_nvshmem.py log=tier3-internode-mps.log
  [[ "$world" == 4 ]] && tier3=tests/gpu/test_internode_2x2.py log=tier3-internode-mps4.log
  [[ -n "${TIER3:-}" ]] && tier3=$TIER3 log=tier3-$(basename "$TIER3" .py)-mps$world.log
  timeout 560 "${pytest[@]}" $tier3 ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/$log" | tail -30 || rc=1
fi

if [[ "$mode" == bench ]]; then
  timeout 560 "${bench[@]}" --cases dsv3 --num-sms 24 ${BENCH_ARGS:-} --out "$OUT/bench-dsv3.jsonl" 2>&1 \
    | tee "$OUT/bench-dsv3.log" | tail -45 || rc=1
fi

if [[ "$mode" == ab ]]; then
  base="${2:?usage: bash scripts/gpu_check.sh ab BASE_DIR (a tree with src/epcomm)}"
  head_commit="${EPCOMM_COMMIT:-}"
  [[ -n "$head_commit" && "${EPCOMM_COMMIT_DIRTY:-}" == 1 ]] && head_commit="$head_commit+dirty"
  timeout 560 "${bench[@]}" --ab "base=$base,head=." --ab-commits "${AB_BASE_COMMIT:-},$head_commit" \
    --rounds "${AB_ROUNDS:-3}" ${BENCH_ARGS:---cases ll-dsv3 --tokens 1,128} --out "$OUT/ab.jsonl" 2>&1 \
    | tee "$OUT/ab.log" | tail -60 || rc=1
fi

if [[ "$mode" == profile ]]; then
  # per operation and rank: a cProfile table of the host path and a torch.profiler table, in $OUT/profile/
  timeout 560 "${bench[@]}" --cases dsv3 --num-sms 24 --iters 20 --warmup 5 --profile "$OUT/profile" \
    ${BENCH_ARGS:-} --out "$OUT/profile-dsv3.jsonl" 2>&1 | tee "$OUT/profile-dsv3.log" | tail -45 || rc=1
  ls "$OUT/profile" 2>/dev/null | head -40
fi

if [[ "$mode" == figures ]]; then
  # file names: <machine>-<UTC time>-<what>.jsonl, e.g. h200x2-0653-ht-dsv3.jsonl
  dir="$OUT/benchmarks/$(date -u +%F)"; mkdir -p "$dir"
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE '[A-Z][0-9]{3}' | head -1)
  tag="$(echo "${gpu:-gpu}" | tr A-Z a-z)$( ((gpus > 1)) && echo "x$gpus")-$(date -u +%H%M)"
  timeout 140 "${bench[@]}" --cases ht-dsv3 --num-sms 24 --out "$dir/$tag-ht-dsv3.jsonl" 2>&1 \
    | tail -12 || rc=1
  timeout 100 "${bench[@]}" --cases ht-dsv3 --num-sms 24 --cached --out "$dir/$tag-ht-dsv3-cached.jsonl" \
    2>&1 | tail -8 || rc=1
  timeout 140 "${bench[@]}" --cases ll-dsv3,ll-dsv3-288 --tokens 1,128 --out "$dir/$tag-ll-dsv3.jsonl" 2>&1 \
    | tail -30 || rc=1
  timeout 200 "${bench[@]}" --cases sweep --num-sms 24 --iters 10 --warmup 2 --out "$dir/$tag-sweep.jsonl" \
    --plot "$dir/$tag-sweep-plots" 2>&1 | tail -12 || rc=1
  ls -l "$dir"
fi
# the device tool brings back at most 8 files (a folder's logs beyond them are left out): everything under $OUT
# also comes back as this one archive, whose name sorts first
(cd "$OUT" && tar -czf 0-out.tgz --exclude=./0-out.tgz .) || rc=1
exit $rc
