"""The request core every transport shares: bodies, `prepare`, the engine-request builders,
response models and conversions, the neutral `RequestError`, auth, metrics and the registry of
running requests. It knows neither HTTP nor gRPC; `service.api` and `service.grpc_api` are thin
over it, and `service.server` composes them."""
