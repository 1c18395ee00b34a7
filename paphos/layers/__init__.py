"""Building blocks of model files: linears (with a quantization hook), norms, RoPE, activations,
embeddings. Model code composes them; the model runner never sees them directly."""
