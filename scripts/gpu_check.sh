#!/usr/bin/env bash
# Issue 22's whole GPU run, in one command on a lent GPU machine (<= 6 minutes), everything under $OUT.
#
# Prepare here first (no GPU needed): ./scripts/gpu_wheels.sh  (wheels + SmolLM2's tokenizer in .whl/).
# Then, through the device tool, from the repo root:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=420)
# It writes to $OUT: nvidia-smi.txt, env.txt, cloud_gpu.log (everything printed, TARGET lines included),
# cloud_gpu_targets.json, cloud_gpu.md (docs/benchmarks/cloud_gpu.md with the new targets block: copy it
# back over the doc and commit it with the GPU named) and cloud_gpu_worker.log (the gRPC row's worker).
# The benchmark saves the report after each shape, so a run cut off by the time limit keeps what it measured.
set -uo pipefail
: "${OUT:?OUT must name the folder for the results}"
cd "$(dirname "$0")/.."
test -f .whl/tokenizer/tokenizer.json || { echo "no .whl/tokenizer: run scripts/gpu_wheels.sh here and carry .whl" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, transformers, sys; print(sys.version); print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))" > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
cp docs/benchmarks/cloud_gpu.md "$OUT/cloud_gpu.md"
# 330 s for the benchmark itself leaves the install and a margin inside 6 minutes.
timeout -k 10 "${GPU_CHECK_BENCH_S:-330}" python3 -m benchmarks.cloud.gpu --device cuda --tokenizer .whl/tokenizer \
  --out "$OUT" "$@" 2>&1 | tee "$OUT/cloud_gpu.log"
status=${PIPESTATUS[0]}
grep '^TARGET' "$OUT/cloud_gpu.log" || echo "no TARGET line: see cloud_gpu.log" >&2
exit "$status"
