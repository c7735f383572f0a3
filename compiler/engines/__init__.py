"""Engines: TensorRT builds per target (builder), their profiles, the engine and timing caches, and the stage
that records each target's engine (records)."""
