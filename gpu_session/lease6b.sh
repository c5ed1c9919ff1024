# MoE + router replay colocated GPU test (timed out at 200 s on a fresh H100 after the GDN check)
source gpu_session/env.sh
mkdir -p $OUT
timeout 500 python3 -m pytest -m gpu -x -v -p no:cacheprovider tests/runner/test_rl_gpu.py -k "moe" -o addopts="" 2>&1 | tee $OUT/moe_test.log | tail -6
# issue 35 (a): where a long-tailed share's extra time goes (profiles of draw 0's shares)
cd bench && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python3 balance_gpu.py --dp 2 --shares-alone --recompute selective --steps 2 --draws 1 --model-dir /tmp/bal_models --profile $OUT/balprof --json $OUT/balance_prof.json 2>&1 | grep "^{" | tail -5
