"""Worker: owns the device, the model, the paged KV cache and the per-request input state."""
