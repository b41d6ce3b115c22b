#!/usr/bin/env bash
# Every test, in two processes side by side on the 2 cores: the real-engine
# tests (pytest -m vllm: one vLLM process starting or answering at a time),
# and the rest (pytest, then the JS client's node tests). About 0.7x of the
# time of one after the other. Exits non-zero if either part failed.
set -uo pipefail
set -m # the real-engine part gets a process group of its own: stopped whole
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
mkdir -p test-artifacts
log=test-artifacts/pytest-vllm.log
"$py" -m pytest -q -m vllm >"$log" 2>&1 &
engine=$!
# Interrupted: stop it and the servers it started (a background job does not
# get the terminal's Ctrl-C).
trap 'kill -TERM -- "-$engine" 2>/dev/null' EXIT
echo ">> the real-engine tests run meanwhile: tail -f $log"
"$py" -m pytest -q -m "not vllm"
rest=$?
(cd client_js && node --test)
node=$?
echo ">> waiting for the real-engine tests"
wait "$engine"
engine_rc=$?
trap - EXIT
echo ">> pytest -m vllm ($log):"
cat "$log"
echo ">> exit codes: pytest -m 'not vllm' $rest, node --test $node, pytest -m vllm $engine_rc"
[ "$rest" = 0 ] && [ "$node" = 0 ] && [ "$engine_rc" = 0 ]
