"""Example models, datasets and configs for CMEMI (importable as `examples.<name>`)."""
