#!/usr/bin/env bash
# Several GPU jobs in one device call, one GPU each, at once.
# Usage: bash scripts/gpu_jobs.sh JOBS_FILE [CAP_S]
#   JOBS_FILE: one job per line (blank lines and '#' lines skipped), a bash command run from the
#   repository root on GPU <its line's index> (CUDA_VISIBLE_DEVICES) with OUT=<its own folder>. A line that
#   starts with 'mps:' runs under a private MPS daemon of its own GPU (its own pipe directory; the daemon
#   sees that GPU alone and the job's processes see it as device 0, CUDA_VISIBLE_DEVICES=0; gpu_check.sh's MPS modes then use it:
#   EPCOMM_MPS_RUNNING=1), others run without MPS. In an MPS job, "$NO_MPS cmd" runs cmd outside the daemon on the
#   job's own GPU (CUDA_VISIBLE_DEVICES=0 there names the daemon's GPU only through the daemon: a process that
#   leaves the daemon with it would run on GPU 0, another job's). One daemon a job: a client that faults or is killed
#   mid-kernel can stop its MPS server for every client, so jobs sharing one server break each other.
#   CAP_S (default 560): every job still running then is killed.
#   Each job's output is in <its folder>/job.log; all of them come back as ONE file, $OUT/jobs.tgz
#   (the device tool returns at most 8 files), and each job's last lines are printed at the end.
# Timing: jobs share the host's CPUs, not their GPUs. Compare timings only within one job.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
file="${1:?usage: bash scripts/gpu_jobs.sh JOBS_FILE [CAP_S]}"; cap="${2:-560}"
OUT="${OUT:-/tmp/epcomm-out}"; mkdir -p "$OUT"
work=/tmp/epcomm-jobs; rm -rf "$work"; mkdir -p "$work"
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
mapfile -t jobs < <(grep -v '^[[:space:]]*\(#\|$\)' "$file")
((${#jobs[@]} <= gpus)) || { echo "${#jobs[@]} jobs for $gpus GPU(s)"; exit 2; }
mps_dirs=()
stop_mps() { for d in "${mps_dirs[@]}"; do echo quit | CUDA_MPS_PIPE_DIRECTORY=$d/pipe nvidia-cuda-mps-control; done; }
trap stop_mps EXIT
pids=()
for i in "${!jobs[@]}"; do
  line="${jobs[$i]}"; dir="$work/job$i"; mkdir -p "$dir"
  devs=$i
  if [[ "$line" == mps:* ]]; then
    line="${line#mps:}"
    d=/tmp/epcomm-jobs-mps/$i; mkdir -p $d/pipe $d/log
    CUDA_VISIBLE_DEVICES=$i CUDA_MPS_PIPE_DIRECTORY=$d/pipe CUDA_MPS_LOG_DIRECTORY=$d/log nvidia-cuda-mps-control -d \
      || { echo "job $i: could not start an MPS daemon"; exit 1; }
    mps_dirs+=("$d")
    # the daemon sees GPU i alone and remaps it to device 0; its clients say 0 too (unset, torch counts
    # every GPU through NVML and asserts on the device the runtime does not have)
    devs=0
    pre="export CUDA_MPS_PIPE_DIRECTORY=$d/pipe CUDA_MPS_LOG_DIRECTORY=$d/log EPCOMM_MPS_RUNNING=1"
    pre+=" NO_MPS='env -u CUDA_MPS_PIPE_DIRECTORY -u CUDA_MPS_LOG_DIRECTORY -u EPCOMM_MPS_RUNNING"
    pre+=" -u EPCOMM_TEST_SHARE_GPU -u CUDA_MPS_ACTIVE_THREAD_PERCENTAGE CUDA_VISIBLE_DEVICES=$i';"
  else
    pre="export NO_MPS=env;"
  fi
  echo "job $i (GPU $i): $line" | tee "$dir/job.log"
  # its own session, so that the cap can kill the job's whole tree (pytest, ranks, benches)
  CUDA_VISIBLE_DEVICES=$devs OUT="$dir" MASTER_PORT=$((8361 + 17 * i)) setsid bash -c "$pre $line" \
    >>"$dir/job.log" 2>&1 &
  pids+=($!)
done
start=$SECONDS
for i in "${!pids[@]}"; do
  left=$((cap - (SECONDS - start))); ((left < 1)) && left=1
  if ! timeout "$left" tail --pid="${pids[$i]}" -f /dev/null; then
    echo "job $i: killed at the ${cap} s cap" | tee -a "$work/job$i/job.log"
    kill -KILL -- "-${pids[$i]}" 2>/dev/null
  fi
  wait "${pids[$i]}"; echo "job $i: exit $?" | tee -a "$work/job$i/job.log"
done
for i in "${!jobs[@]}"; do echo "=== job $i"; tail -n "${TAIL_LINES:-25}" "$work/job$i/job.log"; done
tar -czf "$OUT/jobs.tgz" -C "$work" . && ls -l "$OUT/jobs.tgz"
