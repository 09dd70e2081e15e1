# The image every pod of the KubeRay RayService runs (deployments/kuberay/rayservice.yaml): Ray's own image
# for the Ray and Python versions mmserve pins, the CUDA build of torch, and mmserve installed.
#
#   docker build -t mmserve:latest .
#   docker tag mmserve:latest REGISTRY/mmserve:0.1.0 && docker push REGISTRY/mmserve:0.1.0
#
# One image serves every group: the CPU groups simply never touch the GPU. Nothing is uploaded at deploy
# time, so the code is in the image. tests/unit/deployments/test_dockerfile.py checks these versions against
# pyproject.toml and the configs: change them together.
ARG RAY_VERSION=2.60.0
ARG PYTHON_TAG=py311
FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-gpu

# torch as pinned in pyproject.toml, its CUDA build from PyTorch's index (the wheel brings its own CUDA
# runtime; the nodes' driver must support it: pytorch.org, "Get Started"). Installed first so that
# `pip install` below finds torch==2.13.0 satisfied and keeps this build.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
RUN pip install --no-cache-dir 'torch==2.13.0' --index-url ${TORCH_INDEX}

COPY --chown=ray pyproject.toml README.md /home/ray/mmserve/
COPY --chown=ray mmserve /home/ray/mmserve/mmserve
COPY --chown=ray deployments /home/ray/mmserve/deployments
RUN pip install --no-cache-dir /home/ray/mmserve
