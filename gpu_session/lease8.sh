# one GPU: the long-sequence spans path's GPU test, then the long-tailed shares alone (draw 0)
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
timeout 120 python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/runner/test_attention_gpu.py 2>&1 | grep -E "spans|passed|failed|Error" | tail -14; echo "test at $(( $(date +%s) - t0 )) s"
cd bench && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 400 python3 balance_gpu.py --dp 2 --shares-alone --recompute selective --steps 2 --draws 1 --model-dir /tmp/bal_models --json $OUT/balance_spans.json 2>&1 | grep "^{" | tail -5; echo "balance at $(( $(date +%s) - t0 )) s"
