python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_qwen_omni_resume_gpu.py tests/gpu/test_graphed_extend_gpu.py 2>&1 | grep -v "registered at\|fallthrough" | tail -40
