"""The engine's own ceiling: vLLM's AsyncLLM in process, no network, against tokenwire.

    .venv/bin/python -m benchmarks.engine_ceiling [--concurrency 1 8 32] [--tokens 64]
        [--repeats 3] [--order asyncllm tokenwire] [--quiet-cores 0.15] [--retries 2]

The load of benchmarks/vs_vllm.py (its prompts, 64 tokens, ignore_eos,
temperature 0, all clients released at once at each concurrency) runs
(a) straight into `AsyncLLM.generate` in one process: the same engine args as
    server/tokenwire/engines/vllm.py (float32, max_model_len 2048,
    enforce_eager, prefix caching, stats on with tokenwire's stat loggers,
    VLLM_CPU_KVCACHE_SPACE=1), the prompt rendered by the tokenizer's chat
    template and submitted as token ids, DELTA outputs. This is the most any
    server in front of this engine can deliver on this machine;
(b) through `tokenwire serve --engine vllm` over WebSocket, with the Python
    client (vs_vllm.tokenwire_one).
Never both at once (2 cores): (a) runs in a child process that exits before
(b) starts, and every process of a phase must be gone before the next one.
Each phase is warmed up with one batch at the highest concurrency, then runs
`--repeats` rounds of all levels (levels interleaved, so slow drifts hit
every level alike); every request of every round has its own prompt.

Measured per batch, as in vs_vllm: TTFT is request sent (or submitted) ->
first non-empty text, ITL the gaps between text outputs, tokens/s the batch's
output tokens over its wall time. A level's figure is the median over its
rounds. Beside each batch we record the CPU other programs took on the
machine meanwhile ("other cores"), which is what makes a figure noisy; a
batch above --quiet-cores is run again (up to --retries times).
Writes results/engine_ceiling.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tokenwire.models import resolve_model

from ._compare import (
    TABLE_COLUMNS,
    One,
    batch,
    code_note,
    code_state,
    level_summary,
    measure_level,
    plot_sides,
    ratio_cells,
    ratios,
    round_parser,
    side_cells,
)
from ._server import (
    RESULTS,
    SCRATCH,
    VLLM_SETTINGS,
    save_results,
    tokenwire_server,
    wait_for_descendants,
)
from .vs_vllm import prompt, tokenwire_one

TARGET = 0.95  # tokenwire tokens/s as a fraction of the in-process engine
SIDES = ("asyncllm", "tokenwire")
LABELS = {"asyncllm": "AsyncLLM in process", "tokenwire": "tokenwire (WS)"}


async def rounds(
    one: One, levels: list[int], repeats: int, quiet: float, retries: int
) -> dict[str, list[dict[str, Any]]]:
    """Warm up, then `repeats` rounds of one batch per level."""
    await batch(one, max(levels), 1_000_000)
    runs: dict[str, list[dict[str, Any]]] = {str(c): [] for c in levels}
    for r in range(repeats):
        for c in levels:
            runs[str(c)].append(
                await measure_level(one, c, r, 1, quiet, retries, label=f"  round {r + 1} ")
            )
    return runs


# -- (a) AsyncLLM in process ---------------------------------------------------


def engine_args(model: str) -> Any:
    """The AsyncEngineArgs of server/tokenwire/engines/vllm.py (defaults of tokenwire serve)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=model,
        dtype="float32",
        max_model_len=2048,
        enable_prefix_caching=True,
        enforce_eager=True,
        disable_log_stats=False,
    )


async def asyncllm_one(
    llm: Any, tokenizer: Any, i: int, tokens: int, start: asyncio.Event
) -> dict[str, Any]:
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    await start.wait()
    sent = time.perf_counter()
    # Rendered after the clock starts: tokenwire renders while handling
    # response.create, which its TTFT includes too.
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt(i)}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    stamps: list[float] = []
    count = 0
    async for out in llm.generate({"prompt_token_ids": ids}, params, uuid.uuid4().hex):
        completion = out.outputs[0]
        count += len(completion.token_ids)
        if completion.text:  # tokenwire sends a delta only for non-empty text
            stamps.append(time.perf_counter())
    return {"sent": sent, "stamps": stamps, "tokens": count}


async def asyncllm_phase(args: argparse.Namespace) -> dict[str, Any]:
    from tokenwire.engines.vllm_stats import async_llm, load_tracker_class

    t0 = time.perf_counter()
    # Built as the server builds it, with its stat loggers.
    llm = async_llm(engine_args(str(resolve_model(None))), load_tracker_class())
    startup = time.perf_counter() - t0
    try:
        tokenizer = llm.get_tokenizer()
        runs = await rounds(
            lambda i, s: asyncllm_one(llm, tokenizer, i, args.tokens, s),
            args.concurrency,
            args.repeats,
            args.quiet_cores,
            args.retries,
        )
    finally:
        llm.shutdown()
    return {"startup_s": startup, "runs": runs}


def run_asyncllm_child(args: argparse.Namespace) -> dict[str, Any]:
    """Phase (a) in a child process: when it exits, its engine is gone for sure."""
    SCRATCH.mkdir(exist_ok=True)
    with (
        tempfile.TemporaryDirectory() as tmp,
        open(SCRATCH / "engine-ceiling-asyncllm.log", "wb") as log,
    ):
        out = Path(tmp) / "asyncllm.json"
        cmd = [sys.executable, "-m", "benchmarks.engine_ceiling", "--child-out", str(out)]
        cmd += ["--concurrency", *map(str, args.concurrency)]
        cmd += ["--tokens", str(args.tokens), "--repeats", str(args.repeats)]
        cmd += ["--quiet-cores", str(args.quiet_cores), "--retries", str(args.retries)]
        # The variables tokenwire sets before building its engine.
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        if code != 0:
            raise RuntimeError(f"AsyncLLM phase failed ({code}); see {log.name}")
        return json.loads(out.read_text())


# -- (b) tokenwire ---------------------------------------------------------------


def run_tokenwire(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    with tokenwire_server("--engine", "vllm", "--log-level", "warning", *VLLM_SETTINGS) as url:
        startup = time.perf_counter() - t0
        runs = asyncio.run(
            rounds(
                lambda i, s: tokenwire_one(url, i, args.tokens, s),
                args.concurrency,
                args.repeats,
                args.quiet_cores,
                args.retries,
            )
        )
    return {"startup_s": startup, "runs": runs}


# -- report ------------------------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["concurrency"]
    xs = list(range(len(levels)))
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    plot_sides(axes, report, SIDES, LABELS)
    ax = axes[3]
    ratios = [report["ratios"][str(c)]["tokens_per_s"] for c in levels]
    ax.bar(xs, ratios, 0.5, color="tab:green")
    ax.axhline(TARGET, color="tab:red", linestyle="--", label=f"target {TARGET}")
    ax.set_ylim(min(0.8, *ratios) - 0.02, max(1.05, *ratios) + 0.02)
    ax.set_xticks(xs, [f"c={c}" for c in levels])
    ax.set_title("tokens/s ratio tokenwire / AsyncLLM", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(report: dict[str, Any]) -> str:
    levels, tokens = report["concurrency"], report["tokens"]
    batches = [r for side in SIDES for runs in report[f"{side}_rounds"].values() for r in runs]
    counted = len(batches)
    retried = sum(r["reruns"] for r in batches)
    disturbed = sum(r["other_cores"] > report["quiet_cores"] for r in batches)
    lines = [
        f"{tokens} tokens per request, ignore_eos, temperature 0; SmolLM2-135M float32 on "
        f"{os.cpu_count()} CPU cores. Median of {report['repeats']} rounds per level "
        f"(tokens/s range in brackets); phases in the order {' then '.join(report['order'])}, "
        "never together.",
        "",
        f"| concurrency | path | {TABLE_COLUMNS} | other cores |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in levels:
        for side in SIDES:
            r = report[side][str(c)]
            lines.append(f"| {c} | {LABELS[side]} | {side_cells(r)} | {r['other_cores_max']:.2f} |")
        q = report["ratios"][str(c)]
        mark = "meets" if q["tokens_per_s"] >= TARGET else "**below**"
        lines.append(
            f"| {c} | **ratio tokenwire / AsyncLLM** | **{q['tokens_per_s']:.3f}x** "
            f"({mark} {TARGET}) | {ratio_cells(q)} | |"
        )
    lines += [
        "",
        "AsyncLLM in process: the benchmark calls `AsyncLLM.generate` directly (same engine "
        "args as tokenwire, prompt rendered by the chat template, DELTA outputs); no "
        "sockets, no gateway. tokenwire: `tokenwire serve --engine vllm`, one WebSocket "
        "per request, msgpack, the Python client.",
        f'"other cores": the most CPU other programs on the machine took during one of the '
        f"level's counted batches (of {os.cpu_count()} cores). A batch during which they took "
        f"more than {report['quiet_cores']} cores was run again (at most {report['retries']} "
        f"times; the last attempt counts): {retried} of {counted} batches were, and "
        f"{disturbed} counted batches stayed above the threshold.",
        f"Code: {code_note(report['code'])}; engine startup "
        f"{report['asyncllm_startup_s']:.0f} s in process, "
        f"{report['tokenwire_startup_s']:.0f} s for the server.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = round_parser(__doc__, repeats=3, repeats_help="rounds over all levels", retries=2)
    parser.add_argument(
        "--order", nargs=2, choices=SIDES, default=list(SIDES), help="which phase runs first"
    )
    parser.add_argument("--child-out", help=argparse.SUPPRESS)  # phase (a), in the child
    args = parser.parse_args()
    if args.child_out:
        result = asyncio.run(asyncllm_phase(args))
        Path(args.child_out).write_text(json.dumps(result))
        return
    if sorted(args.order) != sorted(SIDES):
        parser.error("--order takes asyncllm and tokenwire, once each")

    phases: dict[str, dict[str, Any]] = {}
    for side in args.order:
        print(f"{LABELS[side]}:", flush=True)
        phases[side] = run_asyncllm_child(args) if side == "asyncllm" else run_tokenwire(args)
        if side == "asyncllm":  # the child's progress went to its log
            for c, runs in phases[side]["runs"].items():
                print(f"  c={c}: " + ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs))
        leftovers = wait_for_descendants()  # fully down before the other phase starts
        if leftovers:
            print(f"  killed leftover processes {leftovers}", flush=True)

    report: dict[str, Any] = {
        "tokens": args.tokens,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "quiet_cores": args.quiet_cores,
        "retries": args.retries,
        "order": args.order,
        "code": code_state(),
    }
    for side in SIDES:
        report[f"{side}_startup_s"] = phases[side]["startup_s"]
        report[side] = {c: level_summary(runs) for c, runs in phases[side]["runs"].items()}
        report[f"{side}_rounds"] = phases[side]["runs"]
    report["ratios"] = {}
    for c in map(str, args.concurrency):
        tw, ll = report["tokenwire"][c], report["asyncllm"][c]
        report["ratios"][c] = ratios(tw, ll)
    RESULTS.mkdir(exist_ok=True)
    plot(report, RESULTS / "engine_ceiling.png")
    save_results("engine_ceiling", report, markdown(report))
    for c in map(str, args.concurrency):
        q = report["ratios"][c]["tokens_per_s"]
        verdict = "ok" if q >= TARGET else f"BELOW the {TARGET} target"
        print(f"c={c}: tokenwire / AsyncLLM tokens/s = {q:.3f} ({verdict})")


if __name__ == "__main__":
    main()
