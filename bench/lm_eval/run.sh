#!/usr/bin/env bash
# lm-evaluation-harness on the tasks of this folder, twice: through `minipaged serve` (the
# local-completions model: echo + logprobs requests, as it sends to vLLM) and through transformers
# (the hf model); prints both tables, then compares every request's log-likelihood.
#
#   bash bench/lm_eval/run.sh              # the tiny model
#   MODEL=path/to/model bash bench/lm_eval/run.sh
#   SERVE_ARGS="--scheduler v1" bash bench/lm_eval/run.sh   # more options for minipaged serve
#   SERVE_ARGS="--kv-cache-dtype fp8 --calculate-kv-scales" \
#     COMPARE_ARGS="--json bench/results/lm_eval_fp8.json --label fp8_calibrated" bash bench/lm_eval/run.sh
#                                          # stage 13's FP8 cache, its drift kept in bench/results/
#
# lm-eval is not a dependency of minipaged: it is installed once in its own virtual environment,
# build/lm_eval_venv (a few minutes), with the torch, transformers and tokenizers minipaged uses.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-tiny}
PORT=${PORT:-8765}
MAX_LEN=${MAX_LEN:-512}   # the server's --max-model-len, and lm-eval's max_length for both models
TASKS=minipaged_tiny_mc,minipaged_tiny_ppl
VENV=build/lm_eval_venv
OUT=build/lm_eval_results
FOLDER=$(.venv/bin/python -c "from minipaged.models import resolve_model_path; print(resolve_model_path('$MODEL'))")

if [ ! -x "$VENV/bin/lm_eval" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade "pip>=24"
  "$VENV/bin/pip" install --quiet torch==2.13.0  # the CPU build first, as the Makefile does
  grep -E "^(torch|transformers|tokenizers|safetensors|numpy)==" requirements.lock > "$VENV/constraints.txt"
  "$VENV/bin/pip" install --quiet -c "$VENV/constraints.txt" "lm_eval[api,hf]==0.4.*" "pytablewriter>=1"
fi

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rm -rf "$OUT"

# shellcheck disable=SC2086  # SERVE_ARGS is a list of options
.venv/bin/minipaged serve "$MODEL" --port "$PORT" --max-model-len "$MAX_LEN" ${SERVE_ARGS:-} &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  if .venv/bin/python -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" \
      2>/dev/null; then break; fi
  kill -0 "$SERVER" 2>/dev/null || { echo "minipaged serve did not start" >&2; exit 1; }
  sleep 0.5
done

echo "== minipaged serve (local-completions)"
"$VENV/bin/lm_eval" --model local-completions \
  --model_args "model=$MODEL,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=$FOLDER,max_length=$MAX_LEN" \
  --tasks "$TASKS" --include_path bench/lm_eval --output_path "$OUT/server" --log_samples 2>/dev/null

echo "== transformers (hf)"
"$VENV/bin/lm_eval" --model hf --model_args "pretrained=$FOLDER,dtype=float32,max_length=$MAX_LEN" --device cpu \
  --tasks "$TASKS" --include_path bench/lm_eval --output_path "$OUT/hf" --log_samples 2>/dev/null

# shellcheck disable=SC2086  # COMPARE_ARGS is a list of options
"$VENV/bin/python" bench/lm_eval/compare.py "$OUT/server" "$OUT/hf" ${COMPARE_ARGS:-}
