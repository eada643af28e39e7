#!/usr/bin/env bash
# What a session lent a CUDA device checks there, in one run (device time is short): the CUDA-only tests
# (decode graphs captured and replayed against eager, the Triton kernels natively), then `bench throughput` of
# mmserve against mmserve-eager (decode graphs on and off, the same requests) at 1, 8 and 64 streams.
# The device's image has torch, triton and transformers but not every package mmserve imports: run
# `make gpu-wheels` here first and carry `.whl` (the device tool's `carry`). Output: $OUT, else ./gpu-checks.
set -uo pipefail
out=${OUT:-gpu-checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
# The captured-graph test first: a failure elsewhere must not hide it.
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode_graphs.py -k captured_cuda_graphs \
    2>&1 | tee "$out/tests.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode_graphs.py tests/test_triton_kernels.py \
    2>&1 | tee -a "$out/tests.txt"
model=/tmp/bench-qwen2
python3 -m mmserve make-tiny-model --arch qwen2 --preset bench "$model" > /dev/null
for streams in 1 8 64; do
    timeout 150 python3 -m mmserve bench throughput --model "$model" --systems mmserve,mmserve-eager \
        --num-prompts $((streams > 8 ? streams : 8)) --max-num-seqs "$streams" --repeats 3 \
        --json "$out/decode_graphs_$streams.json" 2>&1 | tail -25 | tee -a "$out/bench.txt"
done
