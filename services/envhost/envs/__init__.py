"""Built-in environments: `arith` (default training task), `gsm8k`, `guess-number`.
Registered by name in `opentinker.services.envhost.registry`."""
