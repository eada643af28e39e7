# The vllm-router image (a Rust router published on PyPI).  Build (any context; nothing is copied):
#   docker build -f deploy/router.Dockerfile -t vllm-router:0.1.17 deploy/
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
ARG VLLM_ROUTER_VERSION=0.1.17
RUN pip install "vllm-router==${VLLM_ROUTER_VERSION}"

RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp router
USER 1000
ENV HOME=/tmp

EXPOSE 8000 29000
ENTRYPOINT ["vllm-router"]
CMD ["--help"]
