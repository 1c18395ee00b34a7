"""OpenAI-compatible routes: one module per endpoint family (contract §3)."""
