"""TwELL-JAX: the sparse Llama model and its training."""
