"""One sampler stage per module. Each takes float32 logits [R, V] and per-row parameters, returns
logits with removed tokens at -inf; neutral parameter values are identities."""
