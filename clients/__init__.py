"""rtmedia.clients."""

import os

# Client commands report a failed connection (refused, TLS mismatch) as one line; gRPC
# core's own info logs about it would add more. Set before grpc is first imported; the
# `rtmedia` entry point imports this package first, so `rtmedia serve` gets it too (gRPC core
# errors still reach its log; set GRPC_VERBOSITY yourself to see more).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
