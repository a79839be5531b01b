python3 benchmarks/omni_prefix_reuse.py --model /tmp/omni --device cuda --dtype bfloat16 --history 2000 --rounds 5 --profile 2>&1 | grep -v Warning
