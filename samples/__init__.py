"""Sample models, each with a tensorsmith.toml. `python -m tensorsmith.samples.prepare` writes their data."""
