#!/usr/bin/env bash
# Launch an SGLang server on a CPU for a Qwen3ForCausalLM folder, on 127.0.0.1:PORT, and wait for /health.
#
# Usage: bash scripts/launch_sglang.sh MODEL_DIR PORT [extra sglang.launch_server arguments]
# Env:   SGLANG_PYTHON          the server venv's python (default: $SGLANG_VENV/bin/python, the venv of
#                               scripts/setup_sglang_env.sh)
#        SGLANG_PID_FILE        where the server's PID goes (default: /tmp/sglang-PORT.pid); the server leads its
#                               own process group, so `kill -TERM -- -PID` stops it with its scheduler and
#                               detokenizer processes
#        SGLANG_LOG             the server's log (default: /tmp/sglang-PORT.log)
#        SGLANG_LAUNCH_TIMEOUT  seconds to wait for /health (default 300; 35-51 s were measured on 2 cores)
# Prints the URL on its last line. On failure (the server exits, or no /health in time) it prints the log's tail,
# stops the server and exits 1.
#
# The server's flags on a CPU (docs/sglang.md explains each):
#   SGLANG_USE_CPU_ENGINE=1          SGLang's CPU platform (without it SGLang looks for an accelerator and stops)
#   --device cpu --attention-backend torch_native
#   --dtype float32                  with auto a float32 config is served in float16
#   --mem-fraction-static 0.2 --max-total-tokens 32768 --max-running-requests 64 --context-length 2048
#                                    caps on the KV cache and the batch (the defaults size them for a GPU)
#   --disable-overlap-schedule       no overlap of scheduling and compute
#   --sleep-on-idle                  an idle server sleeps instead of polling (without it: one core busy)
set -euo pipefail
if [[ $# -lt 2 ]]; then
    echo "usage: $0 MODEL_DIR PORT [extra sglang.launch_server arguments]" >&2
    exit 2
fi
MODEL_DIR="$1"
PORT="$2"
shift 2
PY="${SGLANG_PYTHON:-${SGLANG_VENV:-$HOME/.cache/minimind-rl/sglang-venv}/bin/python}"
PID_FILE="${SGLANG_PID_FILE:-/tmp/sglang-$PORT.pid}"
LOG="${SGLANG_LOG:-/tmp/sglang-$PORT.log}"
TIMEOUT="${SGLANG_LAUNCH_TIMEOUT:-300}"
URL="http://127.0.0.1:$PORT"

if [[ ! -f "$MODEL_DIR/config.json" ]]; then
    echo "$MODEL_DIR has no config.json: make the folder with python scripts/convert_model.py to_hf" \
         "--weight full_sft --out $MODEL_DIR --dtype float32" >&2
    exit 2
fi
if [[ ! -x "$PY" ]]; then
    echo "no server python at $PY: run bash scripts/setup_sglang_env.sh, or set SGLANG_PYTHON" >&2
    exit 2
fi
if [[ ! "$PORT" =~ ^[0-9]+$ ]]; then
    echo "PORT must be a number, got '$PORT'" >&2
    exit 2
fi

health() {
    python3 -c "import sys, urllib.request
try:
    sys.exit(urllib.request.urlopen('$URL/health', timeout=5).status != 200)
except Exception:
    sys.exit(1)"
}
if health; then
    echo "a server already answers at $URL/health: pick another PORT" >&2
    exit 2
fi

# Unset: SGLANG_RETURN_ORIGINAL_LOGPROB=1 would make the server's log-probs softmax(logits) instead of the
# trainer's softmax(logits / temperature).
env -u SGLANG_RETURN_ORIGINAL_LOGPROB SGLANG_USE_CPU_ENGINE=1 setsid "$PY" -m sglang.launch_server \
    --model-path "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" \
    --device cpu --attention-backend torch_native --dtype float32 \
    --mem-fraction-static 0.2 --max-total-tokens 32768 --max-running-requests 64 --context-length 2048 \
    --disable-overlap-schedule --sleep-on-idle "$@" > "$LOG" 2>&1 < /dev/null &
PID=$!
echo "$PID" > "$PID_FILE"
echo "SGLang server PID $PID (stop: kill -TERM -- -$PID), log $LOG" >&2

started=$SECONDS
while (( SECONDS - started < TIMEOUT )); do
    if ! kill -0 "$PID" 2>/dev/null; then
        echo "the SGLang server exited during start-up; the end of $LOG:" >&2
        tail -n 30 "$LOG" >&2
        rm -f "$PID_FILE"
        exit 1
    fi
    if health; then
        echo "SGLang server ready at $URL after $((SECONDS - started)) s" >&2
        echo "$URL"
        exit 0
    fi
    sleep 1
done
echo "the SGLang server did not answer $URL/health within $TIMEOUT s; the end of $LOG:" >&2
tail -n 30 "$LOG" >&2
kill -TERM -- "-$PID" 2>/dev/null || true
rm -f "$PID_FILE"
exit 1
