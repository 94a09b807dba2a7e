"""Hugging Face Llama, Mistral and Qwen2 weights: loaded into sharded models, exported back."""
