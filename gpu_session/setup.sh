set -e
t0=$(date +%s)
[ -d /tmp/site/vllm ] || { mkdir -p /tmp/site && cat /tmp/chunks/part_* | xz -d -T16 | tar -x -C /tmp/site; }
pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
find /tmp/site/ray/core /tmp/site/bin -type f -exec chmod +x {} + 2>/dev/null || true
cat > "$(dirname "$(which python3)")/mtprun" <<'PY'
#!/usr/bin/env python3
import sys
from mtprun.cli import main
if __name__ == "__main__":  # spawned reward processes re-run this file as __mp_main__
    sys.exit(main())
PY
chmod +x "$(dirname "$(which python3)")/mtprun"
source gpu_session/env.sh
python3 -c "import vllm, ray, mlflow, megatron.core, trl; print('vllm', vllm.__version__, 'ray', ray.__version__, 'trl', trl.__version__)"
nvidia-smi --query-gpu=name,memory.total --format=csv
echo "setup $(( $(date +%s) - t0 )) s"
