# speech1_bf16 with the stages' processes sharing the GPU through MPS (CUDA's multi-process
# service: their kernels run side by side instead of in time slices). Stops the daemon after.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "MPS did not start"; exit 1; }
python3 benchmarks/speech.py --device cuda --model /tmp/omni --prompt-tokens 64 --rounds 3 --no-reference --concurrency 1 --quantization bf16 --logs /tmp/res/speech-logs-mps
status=$?
echo quit | nvidia-cuda-mps-control
tail -5 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null
exit $status
