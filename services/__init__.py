"""OpenTinker services. Each subpackage is one OS process; they share only `core`
(bus, config, models) and talk only over NATS."""
