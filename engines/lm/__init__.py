"""The local language model engine: a static-KV-cache causal LM with batched decode, its models, Llama
forward pass, int8 layers and synthetic shapes."""
