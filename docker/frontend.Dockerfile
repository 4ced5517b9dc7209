# tandem frontend: CPU only, no torch. Build from the repository root:
#   docker build -f docker/frontend.Dockerfile -t tandem-frontend:dev .
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
COPY . /src
RUN /opt/venv/bin/pip install "/src[frontend]" \
 && ! /opt/venv/bin/python -c "import torch" 2>/dev/null

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/tandem tandem
COPY --from=build /opt/venv /opt/venv
# The root filesystem is mounted read-only in Kubernetes: caches go to an emptyDir at ~/.cache.
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/tandem \
    XDG_CACHE_HOME=/home/tandem/.cache \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/tandem
EXPOSE 50050 9090
ENTRYPOINT ["tandem-frontend"]
