# next lease, call B (two GPUs): issue 35 (a), dp=2 long-tailed GRPO step, Qwen3-1.7B shape
source gpu_session/env.sh
mkdir -p $OUT
cd bench && timeout 560 python3 balance_gpu.py --dp 2 --model-dir /tmp/bal_models --json $OUT/balance.json 2>&1 | grep -v Warning | tail -15
