# call 12: 1.5B cp=1 then cp=2 at 32k, alone (after the ordered key gather and overlap_grad_reduce), then Qwen3.5 cp=2
source gpu_session/env.sh; mkdir -p $OUT
for cp in 1 2; do timeout 200 python3 bench/trainer_gpu.py --workload sft --trainers mtprun --seq 32768 --step-tokens 32768 --recompute selective --cp $cp --model-dir /tmp/tg --json $OUT/cp$cp.json > $OUT/cp$cp.log 2>&1; grep "^| mtprun" $OUT/cp$cp.log || tail -5 $OUT/cp$cp.log; done
timeout 300 python3 bench/trainer_gpu.py --shape qwen3.5-9b --layers 8 --trainers mtprun --cp 2 --seq 32768 --step-tokens 32768 --workload sft --model-dir /tmp/q35 --json $OUT/q35_cp2.json > $OUT/q35_cp2.log 2>&1; grep "^| mtprun" $OUT/q35_cp2.log || tail -5 $OUT/q35_cp2.log
