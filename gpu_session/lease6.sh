# next lease (two GPUs): Qwen3.5 under cp=2 on the GPU (fla path of the GDN context-parallel plan)
# carry [".gdn_gpu"] too; fla 0.6 compiles TileLang kernels at first use (>100 s once)
source gpu_session/env.sh
mkdir -p $OUT
pip install -q --no-index --no-deps --target /tmp/site .gdn_gpu/fla_core-*.whl 2>&1 | tail -1
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 .gdn_gpu/check.py > $OUT/gdn_check.log 2>&1; echo "gdn check rc=$? at $(( $(date +%s) - t0 )) s"
tail -12 $OUT/gdn_check.log | cut -c1-400
timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" tests/kernels/test_gated_delta_gpu.py 2>&1 | tail -3
for cp in 1 2; do
  timeout 200 python3 bench/trainer_gpu.py --shape qwen3.5-9b --layers 8 --trainers mtprun --cp $cp \
    --seq 32768 --step-tokens 32768 --workload sft --model-dir /tmp/q35 --json $OUT/q35_cp$cp.json 2>&1 | grep "^| mtprun" ; echo "cp=$cp rc=$?"
done
