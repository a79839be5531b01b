# token2wav on the GPU: resumed from a checkpoint, and replayed as CUDA graphs (eager and
# compiled forwards, three requests batched so that a replay pads its rows) against eager.
python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_qwen_omni_resume_gpu.py -k token2wav -s 2>&1 | grep -v "registered at\|fallthrough" | tail -30
