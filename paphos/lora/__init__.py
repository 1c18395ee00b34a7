"""LoRA adapters: registration and validation (API process), host cache and device slots (engine
core), and the batched shrink/expand applied beside every projection's base matmul. See
docs/lora.md."""
