# one GPU: GDN cp plan + fla states check, MoE router-replay GPU test, balance shares alone
source gpu_session/env.sh
mkdir -p $OUT
pip install -q --no-index --no-deps --target /tmp/site .gdn_gpu/fla_core-*.whl 2>&1 | tail -1
t0=$(date +%s)
timeout 120 python3 .gdn_gpu/check.py > $OUT/gdn_check.log 2>&1; echo "gdn rc=$? at $(( $(date +%s) - t0 )) s"
tail -14 $OUT/gdn_check.log | cut -c1-400
timeout 200 python3 -m pytest -m gpu -x -q -p no:cacheprovider tests/runner/test_rl_gpu.py -k "moe" -o addopts="" > $OUT/moe_test.log 2>&1; echo "moe rc=$? at $(( $(date +%s) - t0 )) s"
tail -4 $OUT/moe_test.log
cd bench && timeout 240 python3 balance_gpu.py --dp 2 --shares-alone --model-dir /tmp/bal_models --json $OUT/balance_shares.json 2>&1 | grep -v "Warn\|warn\|return func" | tail -12
echo "all at $(( $(date +%s) - t0 )) s"
