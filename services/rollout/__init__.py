"""The rollout service: generation engines and the agent loop (see service.py)."""
