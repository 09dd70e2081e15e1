#!/usr/bin/env bash
# The checks that need a GPU, as one command for a lent device machine (issue 16's device part):
#   - the parity suite against transformers with the engine on CUDA (tiny checkpoints; the oracle on the CPU),
#   - every decoder step waits for the device once (tests/unit/test_cuda_step.py),
#   - the meta-device tests and the sampler's and attention's accelerator paths, run on the GPU's host.
# Logs go to $OUT (or ./device-out); ~5 min on an H100 after the machine's start.
#
# The device image has torch, transformers, safetensors, tokenizers, pillow and numpy, not llguidance:
# carry its wheel (Python 3.12 there) in .whl, ignored by git:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl llguidance
# then `run` with carry [".whl"] and the command `bash scripts/device_check.sh`. A dry run on the CPU (the same
# tests, the CUDA one skipped), with python3 the venv's: `MMSERVE_TEST_DEVICE=cpu OUT=/tmp/dc bash scripts/device_check.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
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
status=0
# NOTE: the matmul-form and weight-layout cases are the CPU's (oneDNN packing); everything else runs on CUDA
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/unit/test_cuda_step.py tests/unit/test_parity.py \
  tests/unit/test_prefix_parity.py -k "not matmul_form and not relaid" 2>&1 | tee "$out/parity.log" || status=1
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/unit/test_meta_device.py \
  tests/unit/decoder/test_sampler.py tests/unit/decoder/test_attention_groups.py 2>&1 | tee "$out/host.log" || status=1
exit $status
