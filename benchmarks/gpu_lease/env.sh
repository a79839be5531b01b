# The device machine's environment for the steps: the carried wheels, the project, no hub, and
# NVLink multicast off (a program that uses it can take the host's shared GPUs out of service).
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
