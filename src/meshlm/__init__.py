"""meshlm: Megatron-style tensor, sequence, pipeline and data parallel LLM training."""

__version__ = "0.1.0"
