# syntax=docker/dockerfile:1.7
# sage-grpo training image: torch 2.13.0 (CUDA 12.8 wheels) on the matching CUDA 12.8 base, DeepSpeed's ops prebuilt.
#
#   docker build --build-arg GIT_COMMIT=$(git rev-parse HEAD) --build-arg VERSION=$(git describe --tags --always) \
#       -t REGISTRY/sage-grpo:$(git rev-parse --short HEAD) .
#   docker run --gpus all -v /data/cache:/cache REGISTRY/sage-grpo:TAG plan configs/hunyuanvideo15_sage_lora.yaml \
#       --gpus-per-node 8 --nodes 1
#
# The torch pin here must stay inside pyproject.toml's torch range (tests/unit/test_docker_image.py checks it), and the
# wheel index's CUDA suffix must match the base images' CUDA version. GIT_COMMIT and VERSION are required: .git is
# not in the image, so they are the only record of which code it holds (the OCI labels, and the commit tag of every
# MLflow run started in it).

ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04

# ---- build: compile DeepSpeed's ops against the exact torch that ships -------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG DEEPSPEED_VERSION=0.19.8
# Ampere (A100 8.0, A10/A40 8.6) and Hopper (H100/H200 9.0). A GPU outside this list would need the ops compiled
# again at run time, with an nvcc the runtime image does not have.
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;9.0"

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ninja-build git libaio-dev \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch from the CUDA wheel index first, so nothing below can pull a different build from PyPI as a dependency.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
 && pip install setuptools wheel packaging ninja numpy

# Prebuild DeepSpeed's ops: CPUAdam (the update stage's optimizer under ZeRO offload), FusedAdam (DeepSpeed's
# optimizer when a config names one) and async I/O (NVMe offload). Compiled here rather than JIT at first use, which
# would need nvcc in the runtime image and keeps one rank compiling for minutes while the others time out waiting.
RUN TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1 DS_BUILD_AIO=1 \
    pip install "deepspeed==${DEEPSPEED_VERSION}" --no-build-isolation \
 && ds_report

# Dependencies before the source, so editing code does not reinstall them.
WORKDIR /app
COPY pyproject.toml README.md ./
COPY constraints ./constraints
# psycopg2 is for the MLflow server (infra/k8s/base/mlflow.yaml), which runs from this image on a Postgres store.
# The constraints pin every dependency to the versions the test suite ran with (scripts/freeze_constraints.sh).
# The gpu extra brings nvidia-ml-py, through which MLflow's system metrics read the GPUs.
RUN mkdir -p core stages pipeline && touch core/__init__.py stages/__init__.py pipeline/__init__.py \
 && pip install -c constraints/production.txt ".[video,gpu]" "psycopg2-binary>=2.9,<3" && pip uninstall -y sage-grpo
# A regular install: deepspeed_configs/ is package data beside the packages (stages/update.py finds it there), and
# the bytecode is compiled now, since the pods' root filesystem is read-only.
COPY sage_grpo ./sage_grpo
COPY core ./core
COPY stages ./stages
COPY pipeline ./pipeline
COPY deepspeed_configs ./deepspeed_configs
RUN pip install --no-deps .

# ---- runtime: the venv, configs and infra scripts on the CUDA runtime -------------------------------------------
# No cuDNN or nvcc here: the torch wheels bring their own CUDA libraries, and the ops were compiled above.
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}

# Checked first, so a build without them fails at once (BuildKit builds this stage beside the long one above).
ARG GIT_COMMIT
ARG VERSION
RUN test -n "${GIT_COMMIT}" -a -n "${VERSION}" \
 || { echo "build with --build-arg GIT_COMMIT=\$(git rev-parse HEAD) --build-arg VERSION=..." >&2; exit 2; }

ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libaio1t64 ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# A uid above the hosts' own users' range (the pods run as it too: infra/k8s).
RUN groupadd --gid 10001 sage && useradd --uid 10001 --gid sage --create-home --shell /bin/bash sage \
 && mkdir -p /cache && chown sage:sage /cache

COPY --from=build /opt/venv /opt/venv
WORKDIR /app
COPY configs ./configs
COPY infra ./infra

ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/sage
# Model weights, datasets and compiled kernels go to the mounted /cache volume, not the container layer: they are
# tens of GB and should survive pod restarts.
ENV HF_HOME=/cache/huggingface TORCH_EXTENSIONS_DIR=/cache/torch_extensions TRITON_CACHE_DIR=/cache/triton
# A failed or timed-out collective aborts the communicator and ends the process, so the job fails fast and restarts
# from its checkpoint instead of hanging; the old name is for libraries that still read it.
ENV TORCH_NCCL_ASYNC_ERROR_HANDLING=1 NCCL_ASYNC_ERROR_HANDLING=1
# On a collective timeout, dump the flight recorder's last collectives so the stuck rank can be found.
ENV TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_NCCL_TRACE_BUFFER_SIZE=2000 NCCL_DEBUG=WARN
# Video-length activations vary in shape from step to step; expandable segments keep fragmentation down.
ENV PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
VOLUME ["/cache"]

# Provenance. MLflow adds MLFLOW_RUN_CONTEXT's tags to every run
# (core/tracking.py resolves them): the commit the code came from. SAGEGRPO_IMAGE becomes the run's container.image;
# the Kubernetes manifests replace it with the reference the pod was started from (registry, digest).
LABEL org.opencontainers.image.title=sage-grpo \
      org.opencontainers.image.revision=${GIT_COMMIT} \
      org.opencontainers.image.version=${VERSION}
ENV SAGEGRPO_IMAGE=sage-grpo:${VERSION} \
    MLFLOW_RUN_CONTEXT="{\"mlflow.source.git.commit\": \"${GIT_COMMIT}\"}"

USER sage
ENTRYPOINT ["sagegrpo"]
CMD ["--help"]
