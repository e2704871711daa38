"""dpjax: dense phrase retrieval (DensePhrases) in JAX/Flax."""
__version__ = "0.1.0"
