# NEXT SESSION (written at the end of the twelfth, 2026-11-28). Kinds lent then: nvidia-h200, -x2.
# Stage as lease20 did (.carry/p1 then .carry/p2 + lease12.sh setup; move gpu_session/old* out of
# the tree for call 1: tree + carry must stay under 64 MiB).
# 1. GPU tests the twelfth session changed after its last lease (the head-loss main_grad test's
#    buffer scale 5d094da; the MTP freeze 3a9a1b4): tests/kernels/test_triton_gpu.py -k "main_grad or device_once",
#    then tests/runner/test_main_grads_gpu.py test_data_parallel_gpu.py (x2 kind).
# 2. ep = 2 (bench (c)): fa65bd0+ against 6d4fce4 (git archive 6d4fce4 mtprun | tar -x -C gpu_session/old_ep),
#    new old new old: run 92 had 240.7 / 243.6 against 246.4 / 247.2 ms.
# 3. Item 2's remaining gap (run 92 profile): expert all-to-alls ~14-23 ms a rank not overlapped.
#    Candidate: the experts' weight-gradient GEMMs deferred behind the dispatch all-to-all's
#    backward (a side stream, joined before finish_grads; DDP's expert buckets must wait for it),
#    or two micro batches interleaved (megatron-core's combined 1F1B A2A overlap).
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_triton_gpu.py -k "main_grad or device_once" > $OUT/t1.log 2>&1; tail -2 $OUT/t1.log
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_main_grads_gpu.py tests/runner/test_data_parallel_gpu.py tests/runner/test_trainer.py -k "gpu or mtp or data_parallel or main_grads" > $OUT/t2.log 2>&1; tail -2 $OUT/t2.log
echo "done at $(( $(date +%s) - t0 )) s"
