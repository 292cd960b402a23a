"""The inference engine: model registry, sampling, scoring and the continuous-batching scheduler.

The HTTP layer imports only `service.engine.types` and `service.engine.errors` (and the loader picks
a front-end); the scheduler is `service.engine.core.EngineCore`, run in an engine process behind
`service.engine.client.EngineClient` or on a thread behind `service.engine.engine.InferenceEngine`.
"""
