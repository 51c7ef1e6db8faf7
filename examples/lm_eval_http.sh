#!/usr/bin/env bash
# lm-evaluation-harness against `detspec serve`, reproducible bit for bit at any concurrency.
#
#   pip install '.[serve]' 'lm-eval[api]>=0.4.13'
#   examples/lm_eval_http.sh [MODEL_DIR] [TASKS]      # default: the built-in model, a local task
#
# The server runs with --deterministic-by-default: lm-eval's requests carry no `deterministic`
# field, and still get bitwise-reproducible scores and generations (system_fingerprint says
# so). lm-eval tokenizes with the server's tokenizer (/tokenizer_info + /tokenize: it picks
# tokenizer_backend=remote by itself) and scores choices with `echo` + `logprobs`.
# Run it twice (or change num_concurrent) and compare the --output_path samples files.
set -euo pipefail
MODEL_DIR=${1:-}
TASKS=${2:-}
PORT=${PORT:-8123}
WORK=$(mktemp -d)

if [ -z "$TASKS" ]; then
    # A local multiple-choice task (no download): YAML + jsonl.
    cat > "$WORK/capitals.jsonl" <<'EOF'
{"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Rome"], "answer": 0}
{"question": "What is the capital of Italy?", "choices": ["Madrid", "Rome", "Paris"], "answer": 1}
{"question": "What is the capital of Spain?", "choices": ["Berlin", "Rome", "Madrid"], "answer": 2}
EOF
    cat > "$WORK/capitals.yaml" <<EOF
task: capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: $WORK/capitals.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
EOF
    TASKS=capitals
    INCLUDE=(--include_path "$WORK")
else
    INCLUDE=()
fi

python -m detspec serve ${MODEL_DIR:+"$MODEL_DIR"} --port "$PORT" --served-model-name m \
    --deterministic-by-default --disable-uvicorn-access-log &
SERVER=$!
trap 'kill $SERVER; rm -rf "$WORK"' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 0.2; done
curl -s "http://127.0.0.1:$PORT/v1/models"; echo

HF_DATASETS_OFFLINE=1 lm_eval --model local-completions --tasks "$TASKS" "${INCLUDE[@]}" \
    --model_args "base_url=http://127.0.0.1:$PORT/v1/completions,model=m,num_concurrent=8,max_retries=1,tokenizer_backend=remote,max_length=512" \
    --log_samples --output_path "$WORK/out"
