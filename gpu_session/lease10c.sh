source gpu_session/env.sh; mkdir -p $OUT/tr
nvidia-smi topo -m; env | grep -i nccl; python3 -c "import torch; print(torch.cuda.nccl.version())"
NCCL_DEBUG=INFO timeout 150 python3 bench/trainer_gpu.py --workload sft --trainers mtprun --seq 32768 --step-tokens 32768 --recompute selective --cp 2 --steps 2 --warmup 1 --model-dir /tmp/tg --profile $OUT/tr > $OUT/dbg.log 2>&1; grep "^| mtprun" $OUT/dbg.log; grep -E "NCCL INFO (Channel 00|Using|comm 0x|P2P|NVLS|proto|Proto|Connected|NET)" $OUT/dbg.log | head -30
for proto in Simple LL128; do NCCL_PROTO=$proto timeout 150 python3 bench/trainer_gpu.py --workload sft --trainers mtprun --seq 32768 --step-tokens 32768 --recompute selective --cp 2 --model-dir /tmp/tg > $OUT/p_$proto.log 2>&1; echo $proto; grep "^| mtprun" $OUT/p_$proto.log || tail -3 $OUT/p_$proto.log; done
gzip $OUT/tr/*.trace.json; ls -la $OUT/tr
