# NEXT SESSION (two GPUs; stage first). Each block its own call (<600 s).
# A: cp=1 vs cp=2 at 32k (after helper-20's overlap_grad_reduce, if it landed) + balance on GPU 1 meanwhile
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 280 python3 bench/trainer_gpu.py --workload sft --trainers mtprun --seq 32768 --step-tokens 32768 --recompute selective --cp 1 --model-dir /tmp/tg --json $OUT/cp1.json > $OUT/cp1.log 2>&1 &
(cd bench && CUDA_VISIBLE_DEVICES=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 400 python3 balance_gpu.py --dp 2 --shares-alone --recompute selective --steps 3 --draws 2 --model-dir /tmp/bal_models --json $OUT/balance.json > $OUT/balance.log 2>&1) &
wait; grep "^| mtprun" $OUT/cp1.log; grep '^{' $OUT/balance.log | tail -3
timeout 250 python3 bench/trainer_gpu.py --workload sft --trainers mtprun --seq 32768 --step-tokens 32768 --recompute selective --cp 2 --model-dir /tmp/tg --json $OUT/cp2.json > $OUT/cp2.log 2>&1; grep "^| mtprun" $OUT/cp2.log
# B (carry .gdn_gpu; fla's TileLang compile ~5 min the first time): Qwen3.5 8 layers cp=1 / cp=2 at 32k
# pip install -q --no-index --no-deps --target /tmp/site .gdn_gpu/fla_core-*.whl
# for cp in 1 2; do timeout 280 python3 bench/trainer_gpu.py --shape qwen3.5-9b --layers 8 --trainers mtprun --cp $cp --seq 32768 --step-tokens 32768 --workload sft --model-dir /tmp/q35 --json $OUT/q35_cp$cp.json 2>&1 | grep "^| mtprun"; done
# C: test_gated_delta_gpu float32 fla-backward errors: pytest -s -k "fp32 and not torch_backward" tests/kernels/test_gated_delta_gpu.py | grep -E "error|assert"
