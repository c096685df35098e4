"""What an operator sees: Prometheus metrics and the metrics port, OpenTelemetry traces, session
recordings."""
