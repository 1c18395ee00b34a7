"""Model definitions (HF architecture name -> class via `registry`). The model runner builds one
model, loads weights into it, and calls forward(input_ids, positions, kv_caches, metadata) each
step, then compute_logits on the rows that sample."""
