"""rtmedia.clients."""

import os

# Client commands report a failed connection (refused, TLS mismatch) as one line; gRPC
# core's own info logs about it would add more. Set before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
