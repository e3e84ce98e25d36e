#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh needs on a lent GPU machine (which reaches no registry): the Python
# wheels of ours its image lacks or holds in another version, and SmolLM2's tokenizer files, all under
# .whl/ (git-ignored; pass `carry: [".whl"]` to the device run). Run here, once, from the repo root.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl/tokenizer
# The versions of our virtualenv (pyproject.toml). The image (KINDS.md) has torch, numpy, safetensors,
# huggingface-hub 1.33 (transformers 5.23 takes >= 1.31), typer, regex, prometheus-client and PyYAML;
# it lacks the rest or holds older transformers/tokenizers/grpcio/protobuf than ours and our generated code.
WHEELS=(
  transformers==5.23.0 tokenizers==0.23.3
  structlog==26.1.0 pydantic==2.14.3 pydantic-core==2.50.4 pydantic-settings==2.16.3 python-dotenv==1.2.4
  annotated-types==0.8.0 typing-inspection==0.4.5
  grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
  redis==8.1.0 opentelemetry-api==1.45.2
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
HF="${1:-$HOME/.cache/meshserve/models/smollm2-135m-instruct/hf}"
for f in tokenizer.json tokenizer_config.json special_tokens_map.json; do
  if [ -f "$HF/$f" ]; then cp "$HF/$f" .whl/tokenizer/; fi
done
test -f .whl/tokenizer/tokenizer.json || { echo "no tokenizer.json in $HF; run meshserve models prepare or pass the hf/ dir" >&2; exit 1; }
du -sh .whl
