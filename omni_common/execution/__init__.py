"""What runners need to execute a model fast, beneath `models`: CUDA graph caches (cuda_graphs),
the compile cache's keep-or-drop decisions (compile_cache) and micro-batching (batching). It
knows no model family and no service."""
