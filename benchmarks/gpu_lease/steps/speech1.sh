python3 benchmarks/speech.py --device cuda --model /tmp/omni --prompt-tokens 64 --rounds 3 --no-reference --concurrency 1 --logs /tmp/res/speech-logs
