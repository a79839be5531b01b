# Installs the carried wheels into /tmp/site, prints the machine's facts, and imports what the
# steps need (a missing package fails here, before any step starts).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
PYTHONPATH=/tmp/site:$PWD python3 -c "
import torch, transformers, diffusers, grpc
import omni_common.models.qwen_omni.thinker, omni_common.models.qwen_omni.token2wav, omnistage_cli.main
import services.coordinator.server, services.gateway.app, omni_common.models.qwenimage.random_model
print('torch', torch.__version__, 'transformers', transformers.__version__, 'diffusers', diffusers.__version__, 'grpc', grpc.__version__)" || exit 1
