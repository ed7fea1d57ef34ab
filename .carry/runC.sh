#!/bin/bash
# call C: the one-kernel lane top-k with the jump search: GPU tests of the flagged paths, f32 adversarial bench, engine GPU test
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 200 python3 -m pytest -q -m gpu tests/test_pallas_topk_lanes.py -k "exact_redo or tie_rows or gpu_configs or dispatch or (lanes_gpu and 256-248320 and (ties or neginf))" > $OUT/tl_gpu.log 2>&1; echo "tl_gpu rc $?"; tail -4 $OUT/tl_gpu.log
timeout 100 python3 bench/topk_kernel.py --rows 1024 --dtypes float32 --ks 64 --no-xla --reps 5 --out $OUT/topk > $OUT/topk.log 2>&1; echo "topk rc $?"
grep -A12 "Lane-buffer" $OUT/topk/topk_bench.md | tail -7
timeout 230 python3 -m pytest -q -m gpu tests/test_gpu_model.py -x > $OUT/gpu_model.log 2>&1; echo "gpu_model rc $?"; tail -3 $OUT/gpu_model.log
