"""The gRPC daemon: config, engine thread, servicers, auth, metrics. Heavy imports stay lazy."""
