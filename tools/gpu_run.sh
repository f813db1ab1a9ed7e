#!/bin/bash
# Issue #43 in one command on a lent GPU (the device tool runs it in the repository root):
# the environment, the native build, the gpu-marked tests, tools/gpu_check.py's parity and
# bench. Logs go to $OUT (at most 8 files come back). Every stage gets what is left of
# GPU_DEADLINE seconds (default 420), so that the command ends in time whatever hangs.
# GPU_STAGES (default: all), GPU_PARITY_MODELS/_DTYPES, SUITE_FILES (default: the whole suite),
# GPU_BENCH_MODEL (gpt166m), GPU_BENCH_ROWS and GPU_LLAMA_ROWS choose the work.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
START=$(date +%s)
DEADLINE=${GPU_DEADLINE:-420}
STAGES=${GPU_STAGES:-build tests suite parity bench llama}
SWAP=$PWD/.gpu-swap
mkdir -p "$SWAP"

stage() {  # stage NAME MAX_SECONDS COMMAND...: output in $OUT/NAME.log, its tail printed
  local name=$1 max=$2 left
  shift 2
  left=$((DEADLINE - ($(date +%s) - START)))
  [ "$left" -lt "$max" ] && max=$left
  if [ "$max" -le 5 ]; then echo "== $name: no time left"; return; fi
  echo "== $name (limit ${max}s, at $(( $(date +%s) - START ))s)"
  timeout -k 5 "$max" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? after $(( $(date +%s) - START ))s"
  tail -n "${TAIL:-30}" "$OUT/$name.log" | cut -c1-400
}
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }

{
  nvidia-smi
  python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'python', sys.version)"
  df -hT . /tmp; nproc; free -g
  python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|peft|accelerate|pybind11|numpy|hypothesis|pytest|safetensors|setuptools) "
  grep -m1 "model name" /proc/cpuinfo; grep -m1 "^flags" /proc/cpuinfo | tr ' ' '\n' | grep -E "avx512|amx" | tr '\n' ' '; echo
  echo "sysfs caches: $(cat /sys/devices/system/cpu/cpu0/cache/index*/level 2>&1 | tr '\n' ' ') / $(cat /sys/devices/system/cpu/cpu0/cache/index*/size 2>&1 | tr '\n' ' ')"
  # glibc's sysconf cache sizes, each in a child of its own (the first GPU session's segfault)
  printf '#include <stdio.h>\n#include <stdlib.h>\n#include <unistd.h>\nint main(int c, char** v) { long n = atoi(v[1]); printf("sysconf(%%ld) = %%ld\\n", n, sysconf(n)); return 0; }\n' > /tmp/sc.c
  gcc -O1 -o /tmp/sc /tmp/sc.c && for n in 190 191 193 194 196 197 199; do /tmp/sc $n || echo "sysconf($n): rc=$?"; done
} > "$OUT/env.log" 2>&1
cut -c1-200 "$OUT/env.log" | grep -vE "^\|  +\|" | head -40

has build && stage build 150 env OFFLOAD_BUILD_JOBS=16 python3 setup.py build_ext --inplace
python3 -X faulthandler -c "import offload; print(offload.native_info())" 2>&1 | tail -5
has tests && TAIL=40 stage gputests 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_engine_gpu.py \
  tests/test_conftest_cuda.py
if has suite; then
  # the CPU suite under the machine's torch, beside the GPU stages: every test not marked gpu
  # (they see no CUDA, tests/conftest.py), over pytest-xdist; test_isa_matrix.py (the CPU
  # kernels' own matrix, minutes in child processes) is left to CI
  left=$((DEADLINE - ($(date +%s) - START) - 10))
  echo "== suite in the background (limit ${left}s, at $(( $(date +%s) - START ))s)"
  ( OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 timeout -k 5 "$left" python3 -m pytest -q -p no:cacheprovider \
      -n "${SUITE_WORKERS:-12}" -m "not gpu" --timeout 300 --deselect tests/test_isa_matrix.py ${SUITE_FILES:-} \
      > "$OUT/suite.log" 2>&1; echo "== suite rc=$? after $(( $(date +%s) - START ))s" >> "$OUT/suite.log" ) &
  SUITE=$!
fi
has parity && TAIL=30 stage parity 200 python3 tools/gpu_check.py parity --device "${GPU_DEVICE:-cuda}" \
  --swap-dir "$SWAP" --models ${GPU_PARITY_MODELS:-gpt llama} --dtypes ${GPU_PARITY_DTYPES:-fp32 bf16}
if has suite; then
  wait "$SUITE"
  tail -n 40 "$OUT/suite.log" | cut -c1-300
fi
if has bench || has llama; then
  nvidia-smi dmon -s u -d 1 > "$OUT/dmon.log" 2>&1 &
  DMON=$!
  # shellcheck disable=SC2086
  has bench && TAIL=12 stage bench 300 python3 tools/gpu_check.py bench --device "${GPU_DEVICE:-cuda}" --swap-dir "$SWAP" \
    --model "${GPU_BENCH_MODEL:-gpt166m}" --rows ${GPU_BENCH_ROWS:-plain device-host host-floor nvme-floor auto} \
    --steps "${GPU_BENCH_STEPS:-3}" --warmup 1 --row-timeout "${GPU_ROW_TIMEOUT:-70}" --json "$OUT/bench.json"
  # what is left of the deadline: a Llama-3.2-1B shape (1.24B), rows in order until it runs out
  # shellcheck disable=SC2086
  has llama && TAIL=10 stage bench-llama 300 python3 tools/gpu_check.py bench --device "${GPU_DEVICE:-cuda}" \
    --swap-dir "$SWAP" --model llama1b --rows ${GPU_LLAMA_ROWS:-plain device-host host-floor} --steps 2 --warmup 1 \
    --row-timeout "${GPU_LLAMA_ROW_TIMEOUT:-100}"
  kill $DMON 2>/dev/null
fi
rm -rf "$SWAP"
echo "== done after $(( $(date +%s) - START ))s"
