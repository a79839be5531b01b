"""Process-level infrastructure shared by every service: gRPC setup, config, logging."""
