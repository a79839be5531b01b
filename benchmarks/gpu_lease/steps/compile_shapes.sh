# The thinker's graphed decode at every batch bucket to 32, compiled per bucket against one
# compile for a row and one shared by every larger bucket: each bucket's first steps (its
# compile and recording, first_steps_s) and its step, each run in an inductor cache of its own.
for shapes in buckets shared; do
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python3 benchmarks/ar_decode_gpu.py --concurrency 1 2 4 8 16 32 \
    --new-tokens 128 --skip attention eager generate --compile-shapes "$shapes" || exit 1
done
