"""Weight formats: how a weight layer's values are stored and read back, one module per format, listed in one
table (table.py). Each format is a precision record (core/precisions.py: element, block, scales) and one
`WeightFormat` (base.py: quantize, dequantize, the graph form TensorRT builds, the form ONNX Runtime measures)."""
