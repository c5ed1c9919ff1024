# NEXT SESSION (written in the fifteenth, 2026-11-28). Staging as lease27.sh's header (.carry was
# re-split: p1 52 MB, p2 13.8 MB; the tree + gpu_session must stay under 64 MiB with p1).
# 1. GPU tests never run on a GPU yet: tests/runner/test_data_parallel_gpu.py::test_uneven_expert_parallel... (uneven ep
#    replicas, the zero-trained micro batch on the Triton head-loss engine) and the dp test.
#      CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_data_parallel_gpu.py
# 2. ep = 2's gap (0.88x on run 97's x4 lease, target 0.92x): the all-to-alls without the host's
#    per-layer wait (fixed-size buffers), not built.
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
case $1 in
test)
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_data_parallel_gpu.py > $OUT/t.log 2>&1; tail -15 $OUT/t.log
  echo "at $(( $(date +%s) - t0 )) s"
  ;;
esac
