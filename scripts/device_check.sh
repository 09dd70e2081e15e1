#!/usr/bin/env bash
# The checks that need a GPU, as one command for a lent device machine (issue 16's device part), in two parts
# for one call each (`bash scripts/device_check.sh tiny`, then `... 4b`; no argument runs both):
#   tiny (~5 min on an H100 after the machine's start):
#   - every decoder step waits for the device once (tests/unit/test_cuda_step.py), first: a broken CUDA path shows
#     within a minute,
#   - the parity suite against transformers with the engine on CUDA (tiny checkpoints; the oracle on the CPU),
#   - the attention's batched groups on CUDA in float32 and bfloat16 (the served dtype's kernels) against a
#     dense float32 reference;
#   4b (~7 min; 17 GB of disk in the checkpoint cache, ~40 GB of GPU memory at its peak):
#   - a random-weight checkpoint of gemma-3-4b's sizes, built (scripts/bench_lib/checkpoint.py),
#   - the step benchmark on it in bfloat16, both systems on the GPU (scripts/bench_step.py),
#   - parity on it, all cases batched and chunked, its oracle on the GPU too (float32, TF32 off).
# Each part runs under a time limit of its own, so that a hang costs that part only; each test under 240 s.
# Logs go to $OUT (or ./device-out).
#
# The device image has torch, transformers, safetensors, tokenizers, pillow and numpy, not llguidance nor
# blake3: carry their wheels (Python 3.12 there) in .whl, ignored by git:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl llguidance blake3
# then `run` with carry [".whl"] and the command `bash scripts/device_check.sh`. A dry run on the CPU (the same
# tests, the CUDA one skipped), with python3 the venv's: `MMSERVE_TEST_DEVICE=cpu OUT=/tmp/dc bash scripts/device_check.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
case "$part" in
  tiny|4b|4b-parity|4b-step|all) ;;
  *) echo "unknown part '$part': tiny, 4b (4b-step then 4b-parity), or all" >&2; exit 2 ;;
esac
out=${OUT:-device-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MMSERVE_TEST_DEVICE=${MMSERVE_TEST_DEVICE:-cuda}
export NVIDIA_TF32_OVERRIDE=0  # float32 parity: no TF32 in cuBLAS or cuDNN (the vision tower's patch conv)
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$out/env.log"
# NOTE: every test and the benchmark import the grammar engine and the item hasher: without them all would fail
# after their loads
python3 -c "import llguidance, blake3" 2>> "$out/env.log" \
  || { echo "llguidance or blake3 is missing: carry .whl (above)" | tee -a "$out/env.log"; exit 1; }
python3 -c "import pytest_timeout" 2> /dev/null \
  || echo "pytest-timeout is missing: no limit per test (each part's own still holds)" | tee -a "$out/env.log"
stamp() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$out/parts.log"; }
tests() {  # tests() LIMIT_S LOG ARGS...: pytest under a wall-clock limit, each test under 240 s
  local limit=$1 log=$2; shift 2
  timeout -k 10 "$limit" python3 -m pytest -q -p no:cacheprovider -o addopts="" -o timeout=240 "$@" 2>&1 | tee "$out/$log"
}
status=0
if [ "$part" = tiny ] || [ "$part" = all ]; then
  stamp tiny
  tests 120 cuda-step.log tests/unit/test_cuda_step.py || status=1
  # NOTE: the matmul-form and weight-layout cases are the CPU's (oneDNN packing); everything else runs on CUDA
  tests 300 parity.log tests/unit/test_parity.py tests/unit/test_prefix_parity.py \
    -k "not matmul_form and not relaid" || status=1
  tests 60 attention.log tests/unit/decoder/test_attention_groups.py -k test_device || status=1
fi
# NOTE: 4b in one call may pass a call's 10 minutes on a bare machine (the build writes 17 GB): then 4b-step and
# 4b-parity in two calls of one warm machine (it is given back after 30 s idle), the second reusing the checkpoint
if [ "$part" != tiny ]; then
  stamp "4b: the checkpoint"
  # ${TEXT_LAYERS:-}: fewer decoder layers, for a dry run on a CPU (6 keeps one full-attention layer)
  layers=${TEXT_LAYERS:+, text_layers=$TEXT_LAYERS}
  ckpt=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); from bench_lib.checkpoint import bench_checkpoint
print(bench_checkpoint('gemma-3-4b'$layers))" 2> "$out/build-4b.log" | tail -n 1) && [ -d "$ckpt" ] \
    || { cat "$out/build-4b.log"; exit 1; }
fi
if [ "$part" = 4b ] || [ "$part" = 4b-step ] || [ "$part" = all ]; then
  stamp "4b: the step benchmark"
  timeout -k 10 360 python3 scripts/bench_step.py --checkpoint gemma-3-4b ${TEXT_LAYERS:+--text-layers $TEXT_LAYERS} \
    --device "$MMSERVE_TEST_DEVICE" --dtype bfloat16 --rounds 1 --out "$out" 2>&1 | tee "$out/step-4b.log" || status=1
fi
if [ "$part" = 4b ] || [ "$part" = 4b-parity ] || [ "$part" = all ]; then
  stamp "4b: parity"
  MMSERVE_TEST_PARITY_CHECKPOINT=$ckpt tests 300 parity-4b.log tests/unit/test_parity.py -k "concurrent or chunked" \
    || status=1
fi
stamp done
exit $status
