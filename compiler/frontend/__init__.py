"""The frontend: a source (factory + checkpoint, .pt2, .onnx) → the fused fp32 graph, verified against it."""
