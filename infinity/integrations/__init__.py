"""Integrations with training frameworks: each is optional and imports its framework itself.

- `infinity.integrations.transformers`: `InfinityTrainer`, transformers' Trainer with the
  model's parameters, gradients and optimizer state in infinity's tiers.

They sit above the engine (they import `infinity`, nothing in `infinity` imports them).
"""
