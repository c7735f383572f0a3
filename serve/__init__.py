"""tensorsmith's server: an OpenAI-compatible HTTP front over an artifact (`tensorsmith serve`).

It imports the runtime only (no torch, no compiler); its own dependencies are the `serve` extra.
"""
