#!/bin/bash
# One GPU session's benchmarks, in priority order, each under its own time limit so that one
# failure or overrun leaves the rest. Logs go to $OUT (or ./gpu_logs). Run from the repo root:
#   bash bench/gpu.sh [names...]
# names: env kernels forward update sampler logprob decode (measured 2026-11-26 on an H200 but decode,
# which stopped at its own check, since fixed) lora lora_update (not yet measured); the decode
# loop's profile and roofline: profile profile_cb sampler7b sampler_scan sampler7b_scan profile7b
# blockwise pallas (measured 2026-11-27 on an H200: BENCHMARKS.md, "Where a decode step goes");
# the 8-bit sampler beside the bf16 one (run with sampler7b): sampler7b_fp8 sampler7b_int8 (not yet measured);
# the cache read in place and each prompt read once, at recipe-like contexts: sampler_long_once
# sampler_long_copy (not yet measured; sampler and sampler7b again give the short contexts' change);
# the attention in one kernel per layer: decode_profile_pallas sampler_pallas sampler7b_pallas (not yet measured).
# Full logs and traces go to $LOGS (default: $OUT), only the summary to $OUT; `bench/gpu.sh pack`
# last tars $LOGS into $OUT/logs.tgz (what comes back from a device call is a few files).
export PYTHONPATH=.:bench PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # PyTorch shares the GPU in the --torch/--reference runs
out=${OUT:-gpu_logs}; logs=${LOGS:-$out}; mkdir -p "$out" "$logs"
py=${PYTHON:-python3}
want=${*:-env decode_profile_pallas sampler_pallas sampler7b_pallas logprob_kernels logprob_mosaic_gpu sampler sampler7b sampler_long_once sampler_long_copy sampler7b_fp8 sampler7b_int8 sampler7b_kv8 sampler7b_w8 profile7b profile decode lora lora_update forward update logprob}
run() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  case " $want " in *" $name "*) ;; *) return;; esac
  echo "=== $name: $* (limit ${limit}s)" | tee -a "$out/summary.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1; local rc=$?
  echo "--- $name rc=$rc in $((SECONDS - t0))s" | tee -a "$out/summary.txt"
  tail -n ${TAIL:-25} "$logs/$name.log" | tee -a "$out/summary.txt"
}
run env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; \
  $py -c 'import jax, flax, optax, orbax.checkpoint as o, torch, transformers; \
print(jax.__version__, flax.__version__, optax.__version__, torch.__version__, transformers.__version__, jax.devices())'"
# The ragged decode kernel's Mosaic GPU schedule compiled and run against NumPy (0.5B and 7B-like shapes).
run kernels 120 $py bench/gpu_kernel_check.py
run forward 120 $py bench/forward.py --preset qwen2.5-0.5b --dtype bfloat16 --batch 8 --length 2048 --reference
run update 200 $py bench/update.py --preset qwen2.5-0.5b --rows 64 --micro-batch-size 8 --attention cudnn --dtype bfloat16 --repeats 3 --torch
run sampler 150 $py bench/sampler.py --preset qwen2.5-0.5b --dtype bfloat16 --batch-sizes 64,256 --repeats 3
run logprob 120 $py bench/logprob.py --tokens 16384 --dtype bfloat16 --repeats 3
# The Mosaic GPU log-prob kernels against xla_chunked (not yet run on a GPU), then timed beside it.
run logprob_kernels 120 $py bench/gpu_logprob_check.py
run logprob_mosaic_gpu 150 $py bench/logprob.py --tokens 16384 --dtype bfloat16 --repeats 3 --implementations xla_chunked,pallas_mosaic_gpu
run decode 90 $py bench/decode_fill.py --preset qwen2.5-0.5b --dtype bfloat16 --repeats 5
run lora 150 $py bench/lora.py --presets qwen2.5-0.5b --dtype bfloat16
run lora_update 150 $py bench/update.py --preset qwen2.5-0.5b --rows 64 --micro-batch-size 8 --attention cudnn --dtype bfloat16 --repeats 3 --lora-rank 64
# The decode loop (issue: the sampler at the bandwidth limit). Command buffers: XLA's default
# list plus WHILE and CONDITIONAL, so the token loop's body can run as one CUDA graph.
cb='--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL'
TAIL=40 run profile 120 $py bench/decode_profile.py --preset qwen2.5-0.5b --rows 64 --trace "$logs/trace_profile"
TAIL=40 run profile_cb 120 env XLA_FLAGS="$cb" $py bench/decode_profile.py --preset qwen2.5-0.5b --rows 64 --trace "$logs/trace_cb"
run sampler7b 240 $py bench/sampler.py --preset qwen2.5-7b --dtype bfloat16 --batch-sizes 64,256 --repeats 3
# The same with the layer loop as a scan (the default before decode_layers: auto unrolls it on GPUs).
run sampler_scan 150 $py bench/sampler.py --preset qwen2.5-0.5b --dtype bfloat16 --batch-sizes 64,256 --repeats 3 --decode-layers scan
run sampler7b_scan 150 $py bench/sampler.py --preset qwen2.5-7b --dtype bfloat16 --batch-sizes 64 --repeats 3 --decode-layers scan
run sampler7b_fp8 150 $py bench/sampler.py --preset qwen2.5-7b --dtype bfloat16 --batch-sizes 64,256 --repeats 3 --weights fp8
run sampler7b_int8 150 $py bench/sampler.py --preset qwen2.5-7b --dtype bfloat16 --batch-sizes 64,256 --repeats 3 --weights int8
# The 8-bit KV cache (rollout.kv_cache), with and without 8-bit weights, at a recipe-like context.
run sampler7b_kv8 200 $py bench/sampler.py --preset qwen2.5-7b --dtype bfloat16 --batch-sizes 256 --prompt-length 512 --new-tokens 512 --repeats 3 --weights fp8 --kv-cache fp8
run sampler7b_w8 200 $py bench/sampler.py --preset qwen2.5-7b --dtype bfloat16 --batch-sizes 256 --prompt-length 512 --new-tokens 512 --repeats 3 --weights fp8
# Recipe-like contexts (prompt 512 + 512 new tokens, 256 rows): each prompt's keys read once for its
# G rows against a copy per row (model.prompt_reads), the slot cache in one array per layer either way.
run sampler_long_once 200 $py bench/sampler.py --preset qwen2.5-0.5b --dtype bfloat16 --batch-sizes 256 --prompt-length 512 --new-tokens 512 --repeats 3 --prompt-reads once
run sampler_long_copy 200 $py bench/sampler.py --preset qwen2.5-0.5b --dtype bfloat16 --batch-sizes 256 --prompt-length 512 --new-tokens 512 --repeats 3 --prompt-reads copy
TAIL=40 run profile7b 150 $py bench/decode_profile.py --preset qwen2.5-7b --rows 64 --top 16 --trace "$logs/trace_7b"
TAIL=8 run blockwise 90 $py bench/decode_profile.py --preset qwen2.5-0.5b --rows 64 --decode-attention blockwise --top 4
TAIL=8 run pallas 90 $py bench/decode_profile.py --preset qwen2.5-0.5b --rows 64 --decode-attention pallas --top 4
# The decode step's attention in one kernel per layer (the new keys written first, the prompt read
# in place, the softmax ended in the kernel; the MLP's gate and up one matmul): its kernels and
# time against dense, at the 0.5B and 7B shapes (BENCHMARKS "Kernels per decode layer").
TAIL=40 run decode_profile_pallas 150 $py bench/decode_profile.py --preset qwen2.5-0.5b --rows 64 --decode-attention pallas --top 16 --trace "$logs/trace_pallas"
run sampler_pallas 150 $py bench/sampler.py --preset qwen2.5-0.5b --dtype bfloat16 --batch-sizes 64,256 --repeats 3 --decode-attention pallas
run sampler7b_pallas 240 $py bench/sampler.py --preset qwen2.5-7b --dtype bfloat16 --batch-sizes 64,256 --repeats 3 --decode-attention pallas
case " $want " in *" pack "*) tar czf "$out/logs.tgz" -C "$logs" . ;; esac
