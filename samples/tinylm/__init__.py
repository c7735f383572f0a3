"""tinylm: a small Llama-architecture decoder trained on text that ships with CPython (samples/tinylm/train.py)."""
