# two GPUs: ep=2 with and without the chunked exchange, then its GPU test
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
timeout 400 python3 bench/moe_gpu.py --layers 8 --ep 2 --trainers mtprun --ep-chunks 1,2 --json $OUT/moe_c.json > $OUT/moe_c.log 2>&1; echo "moe c rc=$? at $(( $(date +%s) - t0 )) s"
grep -v -i warn $OUT/moe_c.log | tail -6 | cut -c1-500
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_expert_exchange_gpu.py 2>&1 | tail -3; echo "at $(( $(date +%s) - t0 )) s"
