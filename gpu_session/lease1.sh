# colocated loop on GPU0 beside the sleep/wake + Ray-actor probes on GPU1
source gpu_session/env.sh
mkdir -p $OUT
CUDA_VISIBLE_DEVICES=0 python3 -c "import sys, pathlib; sys.path.insert(0, 'bench'); import rl_gpu; print(rl_gpu.model_folder(rl_gpu.SHAPES['qwen3-1.7b'], pathlib.Path('/tmp/rl_gpu/models'), 4096, weights=True))"
CUDA_VISIBLE_DEVICES=0 timeout 500 python3 bench/rl_gpu.py loop --shape qwen3-1.7b --placement colocate --steps ${STEPS:-3} --json $OUT/results.jsonl > $OUT/mtprun_colocate.log 2>&1 &
A=$!
( CUDA_VISIBLE_DEVICES=1 timeout 240 python3 gpu_session/probe.py inproc; CUDA_VISIBLE_DEVICES=1 timeout 200 python3 gpu_session/probe.py actor ) > $OUT/probe.log 2>&1
echo "probe done"; grep '"probe"' $OUT/probe.log
wait $A; echo "mtprun rc=$?"
cat $OUT/results.jsonl
tail -15 $OUT/mtprun_colocate.log
