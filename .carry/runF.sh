#!/bin/bash
# call F: the rest of the lane top-k GPU module (the shapes call A left out)
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 280 python3 -m pytest -q -m gpu tests/test_pallas_topk_lanes.py -k "lanes_gpu and (7-248320 or 33-1000)" > $OUT/tl_gpu.log 2>&1; echo "tl_gpu rc $?"; tail -4 $OUT/tl_gpu.log
