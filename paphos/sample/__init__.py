"""Sampling: logits of the rows that sample -> token ids and logprobs (design.md §8)."""
