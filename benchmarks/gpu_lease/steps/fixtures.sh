# The real-size builds (configs only: every process builds the same seeded weights on its device).
python3 -m omnistage_cli fixture --family qwen2.5-omni /tmp/omni --random-weights full >/dev/null &&
python3 -m omnistage_cli fixture /tmp/qi --random-weights full >/dev/null && ls /tmp/omni /tmp/qi
