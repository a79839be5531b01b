"""The network floor: gRPC channels and message limits (rpc), the cluster token and API keys
(auth), TLS (tls) and traces across services (tracing). Transport and runtime both stand on it;
it imports nothing of omnistage above the ground (errors)."""
