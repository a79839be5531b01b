# The graphed decode's GPU tests: the thinker's and the prior's steps, the talker's, the extend.
python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_graphed_decode.py tests/gpu/test_graphed_talker_gpu.py \
  tests/gpu/test_graphed_extend_gpu.py 2>&1 | grep -v "registered at\|fallthrough" | tail -40
