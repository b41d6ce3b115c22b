# vllm-router (https://github.com/vllm-project/router): a Rust binary shipped
# as a Python wheel on PyPI; the version tokenwire's tests run against.
FROM python:3.11-slim
RUN pip install --no-cache-dir vllm-router==0.1.17 \
 && useradd --system router
USER router
EXPOSE 8000
ENTRYPOINT ["vllm-router"]
