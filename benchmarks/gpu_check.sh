#!/usr/bin/env bash
# GPU checks of issue 35 in one go, at most 7.5 minutes (the sum of the step limits) on one H100/H200: the CUDA
# tests (tests/test_cuda.py: the engine's two CUDA paths against ivon-opt with no host sync, and the FSDP2 runs through
# VariationalTrainer, a plain module and an HF ViT), the engine's cost (whole training step IVON ÷ AdamW(fused),
# ViT-small and ViT-base, bf16, batch 128, and peak memory IVON − AdamW: benchmarks/cost.py --gpu) and the main job on
# CUDA (checked by .ci/check_main_job.py). Needs no
# network. Logs and results go to $OUT.
#
#   PYTHONPATH=src OUT=/some/folder bash benchmarks/gpu_check.sh
#   DRY=1 PYTHONPATH=src bash benchmarks/gpu_check.sh     # without a GPU: tiny sizes, checks that the script runs
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DRY=${DRY:-0}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0

step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, record the exit status
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: none"
  $PY - <<'PY'
import importlib
for name in ("torch", "triton", "transformers", "accelerate", "datasets", "ivon", "sklearn", "safetensors", "varsmooth"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as error:  # a missing package is reported, the checks then fail with its name
        print(name, "MISSING:", error)
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
PY
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "$DRY" = 1 ]; then  # on a CPU: compiling the kernels for ViT's 200 tensors alone takes minutes there
  step test_cuda 600 $PY -m pytest -q -rs tests/test_cuda.py
  step cost_gpu 900 $PY benchmarks/cost.py --gpu --models vit_small --rounds 1 --steps 3 --skip 1 --batch 2 \
    --image-size 32 --out "$OUT/cost"
  main_limit=600
else  # 440 s in all (an H100 took 115-130 s for the tests, 82 s for the main job)
  # -v names each test as it ends and --timeout bounds each one, so that a failing run still says which failed
  step test_cuda 180 $PY -m pytest -v -rs --timeout 60 --tb=short --junitxml="$OUT/test_cuda.xml" tests/test_cuda.py
  step cost_gpu 160 $PY benchmarks/cost.py --gpu --rounds 2 --steps 15 --skip 5 --batch 128 --image-size 224 \
    --out "$OUT/cost"
  main_limit=100
fi
step main_job $main_limit sh -c "accelerate launch examples/train_image_classification.py --output_dir '$OUT/main_job' \
  && $PY .ci/check_main_job.py '$OUT/main_job'"
tail -n 3 "$OUT/test_cuda.log"
cat "$OUT/cost/engine_gpu.md" 2>/dev/null || tail -n 20 "$OUT/cost_gpu.log"
tail -n 5 "$OUT/main_job.log"
cat "$OUT/summary.txt"
exit $status
