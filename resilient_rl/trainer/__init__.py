"""Trainer: config, data and the PPO/GRPO fit loop."""
