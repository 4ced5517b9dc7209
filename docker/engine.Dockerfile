# tandem engine: CUDA, torch, Triton kernels. Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t tandem-engine:dev .
# The torch wheel brings its own CUDA libraries; the CUDA runtime base supplies the rest of the
# userland the NVIDIA container toolkit expects. Pick a torch build for your driver with
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_INDEX_URL=""
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# gcc + python3-dev: Triton compiles a small C launcher the first time a kernel runs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
COPY . /src
RUN /opt/venv/bin/pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "/src[engine,triton]" \
 && rm -rf /src

# Ubuntu 24.04 images ship a uid-1000 "ubuntu" user; tandem runs as 10001 like the frontend.
RUN groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/tandem tandem
# The root filesystem is mounted read-only in Kubernetes: every cache goes under ~/.cache
# (an emptyDir) or /tmp (an emptyDir).
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/tandem \
    XDG_CACHE_HOME=/home/tandem/.cache \
    HF_HOME=/home/tandem/.cache/huggingface \
    TRITON_CACHE_DIR=/home/tandem/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/home/tandem/.cache/torchinductor \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/tandem
EXPOSE 50051 9091
ENTRYPOINT ["tandem-engine"]
