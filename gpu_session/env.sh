# sourced by every GPU call after staging
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
export PATH=/tmp/site/bin:$PATH
