"""What every compiler package shares, and nothing else: errors, ONNX load/save, progress, ONNX Runtime session
helpers, metrics, number formats, atomic files, module paths. It imports only `tensorsmith.runtime`
(docs/architecture.md)."""
