"""A real `vllm serve` (vLLM's OpenAI-compatible server) in a subprocess,
serving the bundled SmolLM2 checkpoint: what `--engine remote` drives."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# --enforce-eager: the CPU default compiles with inductor (~80 s more per start).
# --enable-scale-out: offers /inference/v1/generate and the abort endpoint.
# --enable-prompt-tokens-details: usage carries cached_tokens.
FLAGS = (
    "--enforce-eager",
    "--max-model-len",
    "2048",
    "--dtype",
    "float32",
    "--enable-prompt-tokens-details",
    "--enable-scale-out",
)


@dataclass
class VllmOpenAI:
    proc: subprocess.Popen
    port: int
    model: str
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        """A gauge or counter from the server's Prometheus /metrics (summed)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.M)
        values = [float(v) for v in pattern.findall(text)]
        assert values, f"{name} not in /metrics"
        return sum(values)

    def running(self) -> float:
        return self.metric("vllm:num_requests_running") + self.metric("vllm:num_requests_waiting")


@contextmanager
def vllm_serve(
    model: str, port: int, log_path: Path, ready_timeout: float = 300
) -> Iterator[VllmOpenAI]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    log = open(log_path, "wb")
    # Its own process group: the engine core is a child of the API server.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *FLAGS,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    server = VllmOpenAI(proc, port, model, log_path)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(server.url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not ready:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.25)
        yield server
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
        log.close()
