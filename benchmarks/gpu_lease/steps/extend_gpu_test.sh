# The thinker's graphed extend on the GPU alone (padded and flex attention), without the resume tests.
python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_graphed_extend_gpu.py 2>&1 | grep -v "registered at\|fallthrough" | tail -20
