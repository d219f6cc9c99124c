#!/usr/bin/env bash
# Runs on the GPU machine (device tool), from the repo root. Usage:
#   bash scripts/gpu_session.sh PART...   (parts: env tests inductor-tests actor-tests serving-tests engine-step arena-one-gpu triton ptx fixtures capture capture-fast capture-moe)
# Writes logs and results under $OUT (or ./out). Never hangs: every part has a timeout.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
part() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "=== $name exit $? ($(date +%T))"; tail -n 40 "$OUT/$name.log"; }
for p in "$@"; do case $p in
  env) part env 60 bash -c 'nvidia-smi; python3 -c "import torch,triton;print(torch.__version__,triton.__version__,torch.cuda.device_count())"' ;;
  tests) part tests 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests ;;
  capture-moe) part capture_moe 150 python3 scripts/gpu_capture_check.py --out "$OUT/capture_moe" --budget 140 --min-part 20 --parts moe --orders 10 ;;
  capture-fast) part capture_fast 250 python3 scripts/gpu_capture_check.py --out "$OUT/capture" --budget 235 --no-warm-repeat --parts capture,llama --orders 10 ;;
  inductor-tests) part inductor_tests 140 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_inductor_capture.py ;;
  actor-tests) part actor_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_device_actor.py tests/test_inductor_capture.py ;;
  serving-tests) part serving_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serving_gpu.py tests/test_demo.py ;;
  engine-step) part engine_step 280 python3 benchmarks/bench_engine_step.py --model llama --size real --layers 4 --dtype bfloat16 --devices cuda:0 --seqs 64 --context 2048 --prompt 128 --out 64 --steps 30 --json "$OUT/engine_step/engine_step_h200.json" ;;
  arena-one-gpu) part arena_one_gpu 560 python3 -m tessera_actors.cli bench arena --models llama --devices "cuda:0?sms=100,cuda:0?sms=32" --layers 4 --seqs 32 --cache 1024 --prompt 512 --out-tokens 64 --requests 32 --rate 16 --reps 1 --out "$OUT/arena_one_gpu" ;;
  ptx) part ptx 300 python3 scripts/ptx_gpu_check.py --out "$OUT/gpu_check.json" ;;
  triton) part triton 300 python3 scripts/gen_triton_fixtures.py --out "$OUT" --jobs 14 ;;
  fixtures) part fixtures 400 python3 scripts/gen_cuda_fixtures.py --out "$OUT/graphs" ;;
  capture) part capture 500 python3 scripts/gpu_capture_check.py --out "$OUT/capture" --budget 400 ;;
  *) echo "unknown part $p" ;;
esac; done
# the device tool brings back at most 8 files: pack every result folder into one archive
dirs=$(cd "$OUT" && find . -mindepth 1 -maxdepth 1 -type d | sed 's|^./||')
if [ -n "$dirs" ]; then (cd "$OUT" && tar czf results.tgz $dirs && rm -rf $dirs); fi
ls -la "$OUT"
