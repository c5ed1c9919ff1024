# two GPUs: cp=1 (GPU 0) beside the one-GPU MoE reference (GPU 1), then cp=2 on both
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 280 python3 bench/trainer_gpu.py --workload sft --trainers mtprun --seq 32768 --step-tokens 32768 --recompute selective --cp 1 --model-dir /tmp/tg --json $OUT/cp1.json > $OUT/cp1.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 280 python3 bench/moe_gpu.py --trainers mtprun --json $OUT/moe_b.json > $OUT/moe_b.log 2>&1 &
wait; echo "parallel part at $(( $(date +%s) - t0 )) s"
grep "^| mtprun" $OUT/cp1.log; tail -3 $OUT/moe_b.log | cut -c1-400
timeout 250 python3 bench/trainer_gpu.py --workload sft --trainers mtprun --seq 32768 --step-tokens 32768 --recompute selective --cp 2 --model-dir /tmp/tg --json $OUT/cp2.json > $OUT/cp2.log 2>&1; echo "cp2 rc=$? at $(( $(date +%s) - t0 )) s"
grep "^| mtprun" $OUT/cp2.log; tail -3 $OUT/cp2.log | cut -c1-400
