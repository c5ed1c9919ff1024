# mtprun colocated loop on GPU 0 and TRL colocated on GPU 1, same model folder, side by side
source gpu_session/env.sh
mkdir -p $OUT
CUDA_VISIBLE_DEVICES=0 python3 -c "import sys, pathlib; sys.path.insert(0, 'bench'); import rl_gpu; print(rl_gpu.model_folder(rl_gpu.SHAPES['qwen3-1.7b'], pathlib.Path('/tmp/rl_gpu/models'), 4096, weights=True))"
CUDA_VISIBLE_DEVICES=0 timeout 540 python3 bench/rl_gpu.py loop --shape qwen3-1.7b --placement colocate --steps ${STEPS:-4} --json $OUT/results.jsonl > $OUT/mtprun_colocate.log 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=1 timeout 540 python3 bench/trl_grpo_gpu.py --model /tmp/rl_gpu/models/2048x28-w --steps ${STEPS:-4} --json $OUT/results.jsonl > $OUT/trl_colocate.log 2>&1 &
B=$!
wait $A; echo "mtprun rc=$?"; wait $B; echo "trl rc=$?"
cat $OUT/results.jsonl
tail -30 $OUT/mtprun_colocate.log; tail -30 $OUT/trl_colocate.log
