"""Choosing tokens from logits: greedy and seeded sampling (sampler), the filtered distribution
shared with speculative verification (distribution), logits processors (logits_processing) and
logprobs (logprobs)."""
