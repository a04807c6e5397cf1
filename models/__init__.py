"""Reference models for tests, examples and benchmarks; each module exposes build(**config)."""

MODELS = ("mlp", "gpt", "resnet", "unet", "branchy", "recurrent")
