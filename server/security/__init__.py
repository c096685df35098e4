"""The gRPC port's guards: TLS, bearer tokens with quotas, and the admission interceptor."""
