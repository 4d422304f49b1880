"""Integrations with training frameworks: each is optional and imports its framework itself.

- `infinity.integrations.transformers`: `InfinityTrainer`, transformers' Trainer with the
  model's parameters, gradients and optimizer state in infinity's tiers.
- `infinity.integrations.deepspeed`: DeepSpeed's module API (``deepspeed.initialize`` and the
  names around it) for a script written for DeepSpeed.

They sit above the engine (they import `infinity`, nothing in `infinity` imports them).
"""
