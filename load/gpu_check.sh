#!/usr/bin/env bash
# The GPU check of the production path: the trainer agent's GPU detection, a checkpoint Forge
# trained and exported, one training step of it on the GPU, served by `vllm serve`, driven
# through Forge's inference gateway with `forge load inference`.
#
#   load/gpu_check.sh [OUT_DIR]            (default: var/gpu-check)
#   load/gpu_check.sh --dry-run            (no GPU needed: checks every file and tool it would use)
#
# Run from anywhere inside the repository, on a machine with an NVIDIA GPU. It:
#   0. asks the trainer agent's detection (NVML through nvidia-ml-py) for the node's GPUs, their
#      memory and NVLink/PCIe groups, as the agent registers them with the scheduler;
#   1. makes the Forge environment (`make install`, unless .venv exists) and a separate one for
#      vLLM (var/gpu-check/vllm-venv: vLLM pins its own torch, Forge pins torch==2.13.0);
#   2. trains a small Llama with Forge's trainer (the `shakespeare_tiny` recipe at head_dim 64, a
#      shape every vLLM attention backend takes) and takes its Hugging Face export; then runs one
#      optimizer step of that export on the GPU (CUDA torch of the vLLM environment) and serves
#      the result, so the served weights went through a GPU training step;
#   3. serves that folder with `vllm serve` (priority scheduling, an API key) and waits for /health;
#   4. starts the gateway with that vLLM server as its only replica (its model-server URL and
#      token, exactly as the Compose GPU profile and the Kubernetes GPU overlay set them) and
#      waits until it lists the model;
#   5. runs `forge load inference` directly against vLLM and through the gateway (same workload,
#      fixed concurrency), then a Poisson request-rate sweep through the gateway;
#   6. prints the figures side by side (and the gateway's added latency) and leaves every
#      results.json, plot and log under OUT_DIR.
# Every process it starts is stopped on exit. Settings (environment):
#   VLLM_SPEC (vllm)  CONCURRENCY (64)  NUM_PROMPTS (1000)  INPUT_LEN (128)  OUTPUT_LEN (64)
#   RATES (16,64,256)  SWEEP_PROMPTS (300)  TRAIN_STEPS (100)  VLLM_PORT (18000)  GATEWAY_PORT (18080)
#   CORPUS (the recipe's corpus; else the repository's Markdown files are the training text)
#   FORGE_PY (.venv/bin/python: the Forge environment's interpreter)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRIPT="$(realpath "${BASH_SOURCE[0]}")"
DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY_RUN=1
    shift
fi
OUT="$(realpath -m "${1:-$ROOT/var/gpu-check}")"
FORGE_PY="${FORGE_PY:-$ROOT/.venv/bin/python}"
TRAIN_MODULE="forge_training.run"
RECIPES_MODULE="forge_training.recipes"
RECIPE="shakespeare_tiny"
VLLM_SPEC="${VLLM_SPEC:-vllm}"
CONCURRENCY="${CONCURRENCY:-64}"
NUM_PROMPTS="${NUM_PROMPTS:-1000}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-64}"
RATES="${RATES:-16,64,256}"
SWEEP_PROMPTS="${SWEEP_PROMPTS:-300}"
TRAIN_STEPS="${TRAIN_STEPS:-100}"
VLLM_PORT="${VLLM_PORT:-18000}"
GATEWAY_PORT="${GATEWAY_PORT:-18080}"
MODEL="forge-gpu-check"
SERVER_KEY="gpu-check-server-key"
GATEWAY_TOKEN="gpu-check-gateway-token"
TENANT_KEY="gpu-check-tenant-key"

log() { printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT INT TERM

# wait_for URL SECONDS PID [HEADER]: until URL answers 200; fails if PID exits first.
wait_for() {
    local url=$1 seconds=$2 pid=$3 header=${4:-}
    local deadline=$((SECONDS + seconds))
    until curl -sf -o /dev/null ${header:+-H "$header"} "$url"; do
        kill -0 "$pid" 2>/dev/null || die "the process behind $url exited (see $OUT/*.log)"
        ((SECONDS < deadline)) || die "$url did not answer within ${seconds}s"
        sleep 2
    done
}

cd "$ROOT"

# --dry-run: every file, module and tool the real run uses, checked without a GPU.
if ((DRY_RUN)); then
    checks=0
    check() {  # check WHAT COMMAND...: run COMMAND quietly; fail naming WHAT
        local what=$1
        shift
        "$@" >/dev/null 2>&1 || die "dry run: $what"
        checks=$((checks + 1))
        log "ok: $what"
    }
    for tool in curl python3 make; do
        check "tool $tool on PATH" command -v "$tool"
    done
    check "the Forge interpreter $FORGE_PY" test -x "$FORGE_PY"
    check "python3 can make the vLLM environment (venv)" python3 -c "import venv, ensurepip"
    for module in "$TRAIN_MODULE" "$RECIPES_MODULE" forge_trainer_agent.gpus pynvml \
        forge_inference_gateway forge_inference_gateway.cli forge_kit.paths forge_cli.main transformers; do
        check "module $module" "$FORGE_PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"
    done
    check "recipe $RECIPE in the catalogue" "$FORGE_PY" -c "import sys
from $RECIPES_MODULE import RECIPES
sys.exit('$RECIPE' not in RECIPES)"
    check "trainer accepts the command line" "$FORGE_PY" -m "$TRAIN_MODULE" --help
    check "forge load inference accepts its options" "$FORGE_PY" -c \
        "from forge_cli.main import app; app(['load', 'inference', '--help'])"
    check "the agent's GPU detection runs (none here is fine)" "$FORGE_PY" -c \
        "from forge_trainer_agent.gpus import detect_gpus; detect_gpus()"
    check "the GPU training step's program compiles" "$FORGE_PY" -c "compile(open('$SCRIPT').read().split('# <gpu-step>')[-2], 'gpu-step', 'exec')"
    check "the report's program compiles" "$FORGE_PY" -c "compile(open('$SCRIPT').read().split('# <report>')[-2], 'report', 'exec')"
    for file in docker-compose.gpu.yml deploy/k8s-gpu/vllm.yaml deploy/k8s-gpu/kustomization.yaml; do
        check "deployment file $file" test -s "$ROOT/$file"
    done
    check "this script parses" bash -n "$SCRIPT"
    log "dry run: $checks checks passed; on a GPU machine run: load/gpu_check.sh"
    exit 0
fi

mkdir -p "$OUT"
command -v nvidia-smi >/dev/null || die "no nvidia-smi: this check needs an NVIDIA GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

# 1. Environments.
if [[ ! -x "$FORGE_PY" ]]; then
    log "making the Forge environment (make install)"
    make install >"$OUT/install.log" 2>&1 || die "make install (see $OUT/install.log)"
fi

# 0. The trainer agent's own view of this node (what it registers with the scheduler).
"$FORGE_PY" - <<'PY' | tee "$OUT/agent-gpus.txt" || die "the agent's GPU detection found no GPU through NVML"
import sys
from forge_trainer_agent.gpus import detect_gpus

found = detect_gpus()
print(f"agent detection: {len(found.gpus)} GPU(s) via {found.source}")
for g in found.gpus:
    print(f"  {g.index}: {g.type} {g.memory_mb} MiB {g.pci_bus_id} nvlink_group={g.nvlink_group} pcie_group={g.pcie_group}")
sys.exit(0 if found.source == "nvml" and found.gpus else 1)
PY
VLLM_VENV="$OUT/vllm-venv"
if [[ ! -x "$VLLM_VENV/bin/vllm" ]]; then
    log "installing $VLLM_SPEC into $VLLM_VENV"
    python3 -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install -q --upgrade pip >"$OUT/vllm-install.log" 2>&1 || true
    "$VLLM_VENV/bin/pip" install "$VLLM_SPEC" >>"$OUT/vllm-install.log" 2>&1 \
        || die "pip install $VLLM_SPEC (see $OUT/vllm-install.log; the machine needs the package index)"
fi
"$VLLM_VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' | tee "$OUT/vllm-version.txt"

# 2. A checkpoint trained and exported by Forge.
RUN_DIR="$OUT/train"
EXPORT="$RUN_DIR/hf"
if [[ ! -f "$EXPORT/config.json" ]]; then
    corpus_args=()
    if [[ -n "${CORPUS:-}" ]]; then
        corpus_args=(--set "data.corpus=$CORPUS")
    elif ! "$FORGE_PY" -c 'import os, sys
from forge_kit.paths import resolve_data_path
from forge_training.schema import DEFAULT_CORPUS
sys.exit(0 if resolve_data_path(DEFAULT_CORPUS).exists() else 1)'; then
        # No shared corpora here: any English text trains a tokenizer and a model the server can load.
        mkdir -p "$OUT/corpus"
        find "$ROOT" -name '*.md' -not -path '*/.venv/*' -not -path '*/node_modules/*' \
            -not -path "$OUT/*" -exec cat {} + >"$OUT/corpus/repository.txt"
        corpus_args=(--set "data.corpus=$OUT/corpus/repository.txt")
    fi
    log "training a ${TRAIN_STEPS}-step model with Forge's trainer"
    "$FORGE_PY" -m "$TRAIN_MODULE" --recipe "$RECIPE" \
        --set model.hidden_size=256 --set model.intermediate_size=688 --set model.num_heads=4 \
        --set model.num_kv_heads=4 --set data.seq_len=512 --set data.vocab_size=2048 \
        --set "max_steps=$TRAIN_STEPS" --set "eval_interval=$TRAIN_STEPS" \
        --set "checkpoint.interval_steps=$TRAIN_STEPS" --set optim.warmup_steps=10 --set threads=0 \
        ${corpus_args[@]+"${corpus_args[@]}"} \
        --run-dir "$RUN_DIR" --run-id gpu-check >"$OUT/train.log" 2>&1 \
        || die "training (see $OUT/train.log)"
    [[ -f "$EXPORT/config.json" ]] || die "the trainer wrote no Hugging Face export at $EXPORT"
fi
log "checkpoint: $EXPORT ($(tail -n 1 "$OUT/train.log" 2>/dev/null | cut -c1-200))"

# 2b. One optimizer step of the export on the GPU; the result is what vLLM serves.
SERVED="$OUT/served"
log "one training step of the export on the GPU"
"$VLLM_VENV/bin/python" - "$EXPORT" "$SERVED" >"$OUT/gpu-step.log" 2>&1 <<'PY' || die "the GPU training step (see $OUT/gpu-step.log)"
# <gpu-step>
import json, shutil, sys, time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
assert torch.cuda.is_available(), "CUDA is not available to torch"
device = torch.device("cuda")
model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16).to(device)
tokenizer = AutoTokenizer.from_pretrained(src)
text = "To be, or not to be, that is the question. " * 32
batch = tokenizer([text] * 8, return_tensors="pt", truncation=True, max_length=256).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
model.train()
torch.cuda.synchronize()
started = time.perf_counter()
loss = model(**batch, labels=batch["input_ids"]).loss
loss.backward()
optimizer.step()
torch.cuda.synchronize()
elapsed = time.perf_counter() - started
shutil.rmtree(dst, ignore_errors=True)
model.save_pretrained(dst)
tokenizer.save_pretrained(dst)
print(json.dumps({"device": torch.cuda.get_device_name(0), "loss": float(loss), "step_s": round(elapsed, 4)}))
# <gpu-step>
PY
log "GPU step: $(tail -n 1 "$OUT/gpu-step.log")"

# 3. vLLM serving the export.
log "starting vllm serve on :$VLLM_PORT"
"$VLLM_VENV/bin/vllm" serve "$SERVED" --served-model-name "$MODEL" --port "$VLLM_PORT" \
    --host 127.0.0.1 --api-key "$SERVER_KEY" --scheduling-policy priority \
    --max-model-len 512 --enable-prefix-caching >"$OUT/vllm.log" 2>&1 &
PIDS+=($!)
wait_for "http://127.0.0.1:$VLLM_PORT/health" 900 "${PIDS[-1]}"

# 4. The gateway in front of it.
log "starting the gateway on :$GATEWAY_PORT"
env FORGE_INFERENCE_GATEWAY_HTTP_PORT="$GATEWAY_PORT" FORGE_INFERENCE_GATEWAY_GRPC_PORT=0 \
    FORGE_INFERENCE_GATEWAY_AUTH_TOKEN="$GATEWAY_TOKEN" \
    FORGE_INFERENCE_GATEWAY_DATA_DIR="$OUT/gateway-data" \
    FORGE_INFERENCE_GATEWAY_KAFKA_ENABLED=false \
    FORGE_INFERENCE_GATEWAY_MODEL_SERVER_URL="http://127.0.0.1:$VLLM_PORT" \
    FORGE_INFERENCE_GATEWAY_MODEL_SERVER_TOKEN="$SERVER_KEY" \
    FORGE_INFERENCE_GATEWAY_BOOTSTRAP_API_KEY="$TENANT_KEY" \
    FORGE_INFERENCE_GATEWAY_DEFAULT_RPM_LIMIT=1000000 \
    FORGE_INFERENCE_GATEWAY_MAX_INFLIGHT_PER_REPLICA=256 \
    FORGE_INFERENCE_GATEWAY_RESPONSE_CACHE_TTL_S=0 \
    FORGE_INFERENCE_GATEWAY_MODELS_REFRESH_S=2 \
    "$FORGE_PY" -m forge_inference_gateway >"$OUT/gateway.log" 2>&1 &
PIDS+=($!)
wait_for "http://127.0.0.1:$GATEWAY_PORT/readyz" 120 "${PIDS[-1]}"
deadline=$((SECONDS + 60))
until curl -sf -H "Authorization: Bearer $GATEWAY_TOKEN" \
    "http://127.0.0.1:$GATEWAY_PORT/admin/v1/replicas" | grep -q "\"$MODEL\""; do
    ((SECONDS < deadline)) || die "the gateway did not list $MODEL on its vLLM replica within 60s"
    sleep 2
done

# 5. Load: direct, through the gateway, then a rate sweep through the gateway.
load() {  # load NAME BASE_URL KEY ARGS...
    local name=$1 url=$2 key=$3
    shift 3
    log "forge load inference: $name"
    FORGE_CLI_LOAD_API_KEY="$key" "$(dirname "$FORGE_PY")/forge" load inference --base-url "$url" --model "$MODEL" \
        --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
        --tokenizer "$EXPORT" --out "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1 \
        || die "forge load inference $name (see $OUT/$name.log)"
}
load direct "http://127.0.0.1:$VLLM_PORT" "$SERVER_KEY" --max-concurrency "$CONCURRENCY"
load gateway "http://127.0.0.1:$GATEWAY_PORT" "$TENANT_KEY" --max-concurrency "$CONCURRENCY"
# (A later --num-prompts wins over the one load() passes.)
load sweep "http://127.0.0.1:$GATEWAY_PORT" "$TENANT_KEY" --request-rate "${RATES%%,*}" \
    --sweep-rates "$RATES" --num-prompts "$SWEEP_PROMPTS"

# 6. Figures.
"$FORGE_PY" - "$OUT" "$CONCURRENCY" <<'PY'
# <report>
import json
import sys
from pathlib import Path

out, concurrency = Path(sys.argv[1]), sys.argv[2]
runs = {name: json.loads((out / name / "results.json").read_text()) for name in ("direct", "gateway")}
keys = ["completed", "failed", "request_throughput", "output_throughput"]
keys += [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("median", "p99")]
print(f"\nvLLM {(out / 'vllm-version.txt').read_text().strip()} on {(out / 'gpu.txt').read_text().strip()}")
print((out / "agent-gpus.txt").read_text().strip())
print("GPU training step:", (out / "gpu-step.log").read_text().strip().splitlines()[-1])
print(f"closed loop of {concurrency} streams")
print(f"{'':24}{'direct':>14}{'gateway':>14}{'added':>12}")
for key in keys:
    d, g = runs["direct"].get(key), runs["gateway"].get(key)
    if d is None or g is None:
        continue
    added = f"{g - d:+12.2f}" if key.endswith("_ms") else ""
    print(f"{key:24}{d:14.2f}{g:14.2f}{added}")
sweep = out / "sweep" / "sweep.json"
if sweep.exists():
    print("\nthrough the gateway, Poisson arrivals:")
    data = json.loads(sweep.read_text())
    rows = data if isinstance(data, list) else data.get("runs", data.get("results", []))
    for row in rows:
        print(
            f"  rate {row.get('request_rate')}: {row.get('request_throughput', 0):.1f} req/s, "
            f"{row.get('output_throughput', 0):.0f} tok/s, p99 TTFT {row.get('p99_ttft_ms', 0):.1f} ms, "
            f"p99 E2EL {row.get('p99_e2el_ms', 0):.1f} ms, failed {row.get('failed')}"
        )
print(f"\nresults, plots and logs: {out}")
# <report>
PY
