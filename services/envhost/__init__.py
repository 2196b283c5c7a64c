"""envhost: serves AbstractGame environments over NATS request/reply (see service.py)."""
