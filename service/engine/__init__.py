"""The inference engine: model registry, sampling, scoring and the continuous-batching scheduler.

The HTTP layer imports only `service.engine.types` and `service.engine.errors`; the scheduler
itself is `service.engine.engine.InferenceEngine`.
"""
