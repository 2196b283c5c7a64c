"""What every service shares: the bus client, typed config, the embedded NATS server
and model resolution. No service logic lives here."""
