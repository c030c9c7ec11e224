#!/bin/bash
# One GPU session's benchmarks, in priority order, each under its own time limit so that one
# failure or overrun leaves the rest. Logs go to $OUT (or ./gpu_logs). Run from the repo root:
#   bash bench/gpu.sh [names...]
# names: env forward update sampler logprob decode (measured 2026-11-26 on an H200 but decode,
# which stopped at its own check, since fixed) lora lora_update (not yet measured).
export PYTHONPATH=.:bench PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # PyTorch shares the GPU in the --torch/--reference runs
out=${OUT:-gpu_logs}; mkdir -p "$out"
py=${PYTHON:-python3}
want=${*:-env decode lora lora_update forward update sampler logprob}
run() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  case " $want " in *" $name "*) ;; *) return;; esac
  echo "=== $name: $* (limit ${limit}s)" | tee -a "$out/summary.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1; local rc=$?
  echo "--- $name rc=$rc in $((SECONDS - t0))s" | tee -a "$out/summary.txt"
  tail -n 25 "$out/$name.log" | tee -a "$out/summary.txt"
}
run env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; \
  $py -c 'import jax, flax, optax, orbax.checkpoint as o, torch, transformers; \
print(jax.__version__, flax.__version__, optax.__version__, torch.__version__, transformers.__version__, jax.devices())'"
run forward 120 $py bench/forward.py --preset qwen2.5-0.5b --dtype bfloat16 --batch 8 --length 2048 --reference
run update 200 $py bench/update.py --preset qwen2.5-0.5b --rows 64 --micro-batch-size 8 --attention cudnn --dtype bfloat16 --repeats 3 --torch
run sampler 150 $py bench/sampler.py --preset qwen2.5-0.5b --dtype bfloat16 --batch-sizes 64,256 --repeats 3
run logprob 120 $py bench/logprob.py --tokens 16384 --dtype bfloat16 --repeats 3
run decode 90 $py bench/decode_fill.py --preset qwen2.5-0.5b --dtype bfloat16 --repeats 5
run lora 150 $py bench/lora.py --presets qwen2.5-0.5b --dtype bfloat16
run lora_update 150 $py bench/update.py --preset qwen2.5-0.5b --rows 64 --micro-batch-size 8 --attention cudnn --dtype bfloat16 --repeats 3 --lora-rank 64
