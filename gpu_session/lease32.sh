# Lease 32 (nineteenth session, one H200): the colocated sync in parts (CUDA IPC a part at a time).
# calls 1..2: carry .carry_d/pN: mkdir -p /tmp/chunks && cp .carry_d/pN/* /tmp/chunks/
#   (.carry_d: mlflow 3.17.2, datasets, math-verify, renderers, ray 2.52.1, megatron-core 0.16.1,
#   pydantic, ruamel: restaged 2026-11-29 with megatron <0.17; it replaces .carry p1/p2)
# calls: carry .carry_v/pN: mkdir -p /tmp/chunks_v && cp .carry_v/pN/* /tmp/chunks_v/
# then: bash gpu_session/lease32.sh setup ; ... testA ; testB ; mem
set -u
mkdir -p $OUT; t0=$(date +%s)
export PYTHONPATH=/tmp/site:/tmp/site_v:$PWD HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
export PATH=/tmp/site/bin:$PATH
case $1 in
setup)
  mkdir -p /tmp/site /tmp/site_v
  (cat /tmp/chunks/part_* | xz -d -T8 | tar -x -C /tmp/site) &
  (cat /tmp/chunks_v/part_* | xz -d -T8 | tar -x -C /tmp/site_v) &
  wait
  find /tmp/site/ray/core /tmp/site/bin -type f -exec chmod +x {} + 2>/dev/null || true
  cat > "$(dirname "$(which python3)")/mtprun" <<'PY'
#!/usr/bin/env python3
import sys
from mtprun.cli import main
if __name__ == "__main__":  # spawned reward processes re-run this file as __mp_main__
    sys.exit(main())
PY
  chmod +x "$(dirname "$(which python3)")/mtprun"
  python3 -c "import vllm, ray, mlflow, megatron.core; print('vllm', vllm.__version__, 'ray', ray.__version__, 'mlflow', mlflow.__version__)" 2>&1 | tail -1
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  echo "at $(( $(date +%s) - t0 )) s"
  ;;
testA)
  timeout 560 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/runner/test_rl_gpu.py -k "sleeps_wakes or (colocated_run and (dense or lora))" > $OUT/tA.log 2>&1
  grep -E "passed|failed|^E |Error" $OUT/tA.log | head -30; echo "at $(( $(date +%s) - t0 )) s"
  ;;
testB)
  timeout 560 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/runner/test_rl_gpu.py -k "colocated_run and (mtp or moe)" > $OUT/tB.log 2>&1
  grep -E "passed|failed|^E |Error" $OUT/tB.log | head -30; echo "at $(( $(date +%s) - t0 )) s"
  ;;
mem)
  cd bench && timeout 500 python3 sync_memory_gpu.py --shape qwen3-8b --model-dir /tmp/syncmem --json $OUT/sync_memory_ipc_8b.json > $OUT/mem.log 2>&1
  cat $OUT/mem.log | grep '^{' ; grep -i "error\|Traceback" $OUT/mem.log | head -5; echo "at $(( $(date +%s) - t0 )) s"
  ;;
esac
