# Lease 13 (nvidia-h100-x4): clip folded into AdamW (GPU tests + MoE step), ep=2 at 8 layers (dedup)
# call 1: carry .carry/p1: mkdir -p /tmp/chunks && cp .carry/p1/* /tmp/chunks/
# call 2: carry .carry/p2: cp .carry/p2/* /tmp/chunks/ && bash gpu_session/lease12.sh setup
# call 3: bash gpu_session/lease13.sh
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
(cd bench && CUDA_VISIBLE_DEVICES=2,3 timeout 265 python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 3 --json $OUT/ep2_8.json > $OUT/ep2_8.log 2>&1) &
(cd bench && export CUDA_VISIBLE_DEVICES=1
 timeout 90 python3 moe_gpu.py --trainers mtprun --warmup 2 --steps 4 --json $OUT/b_fold.json > $OUT/b_fold.log 2>&1
 timeout 90 python3 moe_gpu.py --trainers mtprun --optimizer-state bfloat16 --warmup 2 --steps 4 --json $OUT/b_fold_bf16.json > $OUT/b_fold_bf16.log 2>&1
 timeout 80 python3 moe_gpu.py --trainers mtprun --dispatchers megatron --warmup 2 --steps 4 --json $OUT/b_meg.json > $OUT/b_meg.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=0
 timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_clip_in_step_gpu.py tests/runner/test_optimizer_state_gpu.py tests/runner/test_main_grads_gpu.py > $OUT/gpu_tests.log 2>&1
 cd bench && timeout 120 python3 moe_gpu.py --trainers hf --warmup 2 --steps 4 --json $OUT/b_hf.json > $OUT/b_hf.log 2>&1) &
wait; echo "all at $(( $(date +%s) - t0 )) s"
tail -3 $OUT/gpu_tests.log | cut -c1-300
grep -h '^{"trainer' $OUT/*.log | cut -c1-300
