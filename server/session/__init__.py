"""A duplex session: its state machine, config, limits, outbox, conversation items, replies, function calls
and interruptions."""
