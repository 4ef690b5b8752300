#!/usr/bin/env bash
# The GPU check of the production path: the trainer agent's GPU detection, Forge's own trainer on
# every visible GPU (DDP, FSDP, a crash and exact resume), its export served by vLLM on the GPU,
# driven through Forge's inference gateway with `forge load inference`, and one table of the
# measured figures beside the parallelism planner's predictions for the same shape.
#
#   load/gpu_check.sh [OUT_DIR]            (default: var/gpu-check)
#   load/gpu_check.sh --dry-run            (no GPU needed: checks every file, tool and setting it uses)
#
# Run from anywhere inside the repository, on a machine with NVIDIA GPUs. It:
#   0. asks the trainer agent's detection (NVML through nvidia-ml-py) for the node's GPUs, their
#      memory and NVLink/PCIe groups, as the agent registers them with the scheduler;
#   1. makes the Forge environment (`make install`, unless .venv exists; PyPI's torch wheel is the
#      CUDA build) and a separate one for vLLM (OUT_DIR/vllm-venv: vLLM pins its own torch);
#   2. trains a small Llama (the `shakespeare_tiny` recipe at head_dim 64, a shape every vLLM
#      attention backend takes) with `torchrun -m forge_training.run` on every GPU the node shows,
#      one rank per GPU (`device=cuda`, `precision=PRECISION`): under DDP, under FSDP, and under
#      DDP once more, stopped without saving 5 steps after its mid-run checkpoint (as a crash)
#      and started again, which must resume from that checkpoint and end where the uninterrupted
#      run ended;
#   3. serves the DDP run's Hugging Face export with vLLM's OpenAI server on the GPU
#      (`python -m vllm.entrypoints.openai.api_server`, priority scheduling, an API key);
#   4. starts the gateway with that vLLM server as its only replica (its model-server URL and
#      token, exactly as the Compose GPU profile and the Kubernetes GPU overlay set them) and
#      waits until it lists the model;
#   5. runs `forge load inference` directly against vLLM and through the gateway (same workload,
#      fixed concurrency), then a Poisson request-rate sweep through the gateway;
#   6. prints one table: tokens/s, MFU, checkpoint stall and GPU memory of the DDP and FSDP runs
#      beside the planner's tokens/s, MFU and memory for the same model, GPUs and batch; the
#      resumed run's final loss against the uninterrupted one's; the serving figures (and the
#      gateway's added latency). Every results.json, metrics.jsonl, plot and log stays under OUT_DIR.
# Every process it starts is stopped on exit. Settings (environment):
#   VLLM_SPEC (vllm)  CONCURRENCY (64)  NUM_PROMPTS (1000)  INPUT_LEN (128)  OUTPUT_LEN (64)
#   RATES (16,64,256)  SWEEP_PROMPTS (300)  TRAIN_STEPS (100)  VLLM_PORT (18000)  GATEWAY_PORT (18080)
#   PRECISION (bf16)  MICRO_BATCH (16)  GRAD_ACCUM (2: the global batch is GPUs x MICRO_BATCH x GRAD_ACCUM)
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
PRECISION="${PRECISION:-bf16}"
MICRO_BATCH="${MICRO_BATCH:-16}"
GRAD_ACCUM="${GRAD_ACCUM:-2}"
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
        forge_inference_gateway forge_inference_gateway.bench.load_cli forge_kit.paths forge_cli.main transformers; do
        check "module $module" "$FORGE_PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"
    done
    check "recipe $RECIPE in the catalogue" "$FORGE_PY" -c "import sys
from $RECIPES_MODULE import RECIPES
sys.exit('$RECIPE' not in RECIPES)"
    check "forge load inference accepts its options" "$FORGE_PY" -c \
        "from forge_cli.main import app; app(['load', 'inference', '--help'])"
    check "the agent's GPU detection runs (none here is fine)" "$FORGE_PY" -c \
        "from forge_trainer_agent.gpus import detect_gpus; detect_gpus()"
    check "the trainer takes the check's settings (DDP and FSDP on 2 ranks, $PRECISION)" "$FORGE_PY" -c "
from forge_training import recipes, run, validation
for mode in ('ddp', 'fsdp'):
    sets = [f'{k}={v}' for k, v in (
        ('model.hidden_size', 256), ('model.intermediate_size', 688), ('model.num_layers', 4),
        ('model.num_heads', 4), ('model.num_kv_heads', 4), ('data.seq_len', 512), ('data.vocab_size', 2048),
        ('micro_batch_size', $MICRO_BATCH), ('global_batch_size', 2 * $MICRO_BATCH * $GRAD_ACCUM),
        ('checkpoint.interval_steps', 50), ('device', 'cuda'), ('precision', '$PRECISION'),
        ('parallelism', mode), ('data.corpus', '$ROOT/README.md'))]
    validation.validate(recipes.build('$RECIPE', run.parse_overrides(sets)), 2)"
    check "the trainer's command line takes --stop-after-step" bash -c "'$FORGE_PY' -m $TRAIN_MODULE --help | grep -q -- --stop-after-step"
    check "torchrun is in the Forge environment" "$FORGE_PY" -m torch.distributed.run --help
    check "the planner predicts the check's shape" env GPU_CHECK_PLAN_ONLY=1 "$FORGE_PY" -c "exec(compile(open('$SCRIPT').read().split('# <report>')[-2], 'report', 'exec'))"
    check "the report's program compiles" "$FORGE_PY" -c "compile(open('$SCRIPT').read().split('# <report>')[-2], 'report', 'exec')"
    for file in docker-compose.gpu.yml deploy/k8s-gpu/orchestrator-serving.yaml deploy/k8s-gpu/kustomization.yaml; do
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

# 2. Forge's trainer on every visible GPU: DDP, FSDP, and a DDP run stopped as a crash would
#    (no save) after its mid-run checkpoint, then started again: it resumes from that checkpoint.
NGPU="$(nvidia-smi -L | grep -c '^GPU ')"
((NGPU > 0)) || die "nvidia-smi lists no GPU"
GLOBAL_BATCH=$((NGPU * MICRO_BATCH * GRAD_ACCUM))
HALF=$((TRAIN_STEPS / 2))
corpus_args=()
if [[ -n "${CORPUS:-}" ]]; then
    corpus_args=(--set "data.corpus=$CORPUS")
elif ! "$FORGE_PY" -c 'import sys
from forge_kit.paths import resolve_data_path
from forge_training.schema import DEFAULT_CORPUS
sys.exit(0 if resolve_data_path(DEFAULT_CORPUS).exists() else 1)'; then
    # No shared corpora here: any English text trains a tokenizer and a model the server can load.
    mkdir -p "$OUT/corpus"
    find "$ROOT" -name '*.md' -not -path '*/.venv/*' -not -path '*/node_modules/*' \
        -not -path "$OUT/*" -exec cat {} + >"$OUT/corpus/repository.txt"
    corpus_args=(--set "data.corpus=$OUT/corpus/repository.txt")
fi
# The shape (head_dim 64: every vLLM attention backend takes it) and the settings of every run.
SETTINGS=(
    --set model.hidden_size=256 --set model.intermediate_size=688 --set model.num_layers=4
    --set model.num_heads=4 --set model.num_kv_heads=4 --set data.seq_len=512 --set data.vocab_size=2048
    --set "micro_batch_size=$MICRO_BATCH" --set "global_batch_size=$GLOBAL_BATCH"
    --set "max_steps=$TRAIN_STEPS" --set "eval_interval=$TRAIN_STEPS" --set log_interval=10
    --set "checkpoint.interval_steps=$HALF" --set optim.warmup_steps=10 --set threads=0
    --set device=cuda --set "precision=$PRECISION"
)
forge_train() {  # forge_train NAME PARALLELISM [run.py options...]: torchrun on every GPU
    local name=$1 parallelism=$2
    shift 2
    "$FORGE_PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m "$TRAIN_MODULE" \
        --recipe "$RECIPE" "${SETTINGS[@]}" --set "parallelism=$parallelism" \
        ${corpus_args[@]+"${corpus_args[@]}"} \
        --run-dir "$OUT/$name" --run-id "$name" --objects "$OUT/objects" "$@"
}
rm -rf "$OUT/objects" "$OUT/ddp" "$OUT/fsdp" "$OUT/resumed"
log "training on $NGPU GPU(s) with Forge's trainer: DDP, $TRAIN_STEPS steps, $PRECISION"
forge_train ddp ddp >"$OUT/ddp.log" 2>&1 || die "DDP training (see $OUT/ddp.log)"
log "FSDP, $TRAIN_STEPS steps"
forge_train fsdp fsdp >"$OUT/fsdp.log" 2>&1 || die "FSDP training (see $OUT/fsdp.log)"
log "DDP again, stopped without saving after step $((HALF + 5)), then resumed"
forge_train resumed ddp --stop-after-step $((HALF + 5)) >"$OUT/resumed-1.log" 2>&1 \
    || die "the interrupted run (see $OUT/resumed-1.log)"
forge_train resumed ddp >"$OUT/resumed.log" 2>&1 || die "the resumed run (see $OUT/resumed.log)"
grep -q 'train.resumed' "$OUT/resumed.log" || die "the second run did not resume (see $OUT/resumed.log)"
EXPORT="$OUT/ddp/hf"
[[ -f "$EXPORT/config.json" ]] || die "the trainer wrote no Hugging Face export at $EXPORT"
log "export: $EXPORT"

# 3. vLLM serving the export.
log "starting vLLM's OpenAI server on :$VLLM_PORT"
"$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$EXPORT" \
    --served-model-name "$MODEL" --port "$VLLM_PORT" --host 127.0.0.1 --api-key "$SERVER_KEY" \
    --scheduling-policy priority --max-model-len 512 --enable-prefix-caching >"$OUT/vllm.log" 2>&1 &
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

# 6. Figures, beside the planner's predictions for the same shape.
"$FORGE_PY" - "$OUT" "$CONCURRENCY" "$NGPU" "$MICRO_BATCH" "$GLOBAL_BATCH" "$TRAIN_STEPS" <<'PY'
# <report>
import json
import os
import sys
from pathlib import Path

from forge_training.plan import planner
from forge_training.plan import spec as plan_spec

#: The planner's GPU preset for the name nvidia-smi reports (None: no preset, no prediction).
PRESETS = (("H200", "h200"), ("H100", "h100-80gb"), ("L40S", "l40s"))


def preset_for(name: str, memory_mib: float) -> str | None:
    for part, preset in PRESETS:
        if part in name:
            return preset
    if "A100" in name:
        return "a100-80gb" if memory_mib > 60000 else "a100-40gb"
    return None


def predict(gpu_name: str, memory_mib: float, gpus: int, micro: int, global_batch: int) -> dict:
    """The planner's best layout for the check's model (4 x 256, 688 MLP, 2048 vocab, 512 tokens)."""
    preset = preset_for(gpu_name, memory_mib)
    if preset is None:
        return {"note": f"no planner preset for {gpu_name!r}"}
    model = plan_spec.resolve_model("4M", layers=4, hidden=256, heads=4, kv_heads=4, ffn=688, vocab=2048)
    request = plan_spec.PlanRequest(
        model=model,
        gpu=plan_spec.resolve_gpu(preset),
        gpus=gpus,
        seq_len=512,
        global_batch_seqs=global_batch,
        micro_batch=micro,
    )
    best = planner.candidate_dict(planner.plan(request).best)
    return {
        "tokens_per_s": best["tokens_per_s"],
        "mfu": best["mfu"],
        "mem_gib": best["memory_bytes"]["total"] / 2**30,
        "layout": f"tp{best['tp']} pp{best['pp']} dp{best['dp']} zero{best['zero']}",
    }


if os.environ.get("GPU_CHECK_PLAN_ONLY"):  # the dry run: the prediction for 2 H100s
    print(json.dumps(predict("NVIDIA H100 80GB HBM3", 81559, 2, 16, 64)))
    sys.exit(0)

out, concurrency, ngpu = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
micro, global_batch, steps = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])


def summary(name: str) -> dict:
    """The trainer's last line (rank 0's JSON summary)."""
    for line in reversed((out / f"{name}.log").read_text().splitlines()):
        if line.startswith("{") and '"outcome"' in line:
            return json.loads(line)
    raise SystemExit(f"no summary in {out / name}.log")


def final_loss(name: str) -> float:
    losses = [json.loads(ln) for ln in (out / name / "metrics.jsonl").read_text().splitlines()]
    return [m["loss"] for m in losses if m.get("step") == steps and "loss" in m][-1]


gpu_name, memory = (out / "gpu.txt").read_text().splitlines()[0].split(",")[:2]
memory_mib = float(memory.strip().split()[0])
predicted = predict(gpu_name.strip(), memory_mib, ngpu, micro, global_batch)
print(f"\nForge's trainer on {ngpu} x {gpu_name.strip()} ({(out / 'vllm-version.txt').read_text().strip()})")
print((out / "agent-gpus.txt").read_text().strip())
fmt = "{:8}{:>12}{:>8}{:>14}{:>12}   {:>14}{:>8}{:>10}  {}"
print(fmt.format("", "tokens/s", "MFU", "ckpt stall s", "GPU mem GiB", "plan tokens/s", "MFU", "mem GiB", "layout"))
for name in ("ddp", "fsdp"):
    s = summary(name)
    mfu = f"{s['mfu']:.1%}" if s.get("mfu") is not None else "n/a"
    stall = max(s.get("checkpoint_stalls_s") or [0.0])
    mem = s.get("gpu_mem_peak_allocated_gib", float("nan"))
    p = predicted
    row = (f"{p['tokens_per_s']:,.0f}", f"{p['mfu']:.1%}", f"{p['mem_gib']:.2f}", p["layout"]) if "mfu" in p else ("-", "-", "-", p["note"])
    print(fmt.format(name, f"{s['tokens_per_s']:,.0f}", mfu, f"{stall:.4f}", f"{mem:.2f}", *row))
a, b = final_loss("ddp"), final_loss("resumed")
print(f"resume: loss at step {steps} uninterrupted {a:.6f}, resumed {b:.6f} (|diff| {abs(a - b):.2e}); "
      f"val_loss {summary('ddp')['val_loss']:.6f} vs {summary('resumed')['val_loss']:.6f}")
runs = {name: json.loads((out / name / "results.json").read_text()) for name in ("direct", "gateway")}
keys = ["completed", "failed", "request_throughput", "output_throughput"]
keys += [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("median", "p99")]
print(f"\nserving the DDP export with vLLM, closed loop of {concurrency} streams")
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
