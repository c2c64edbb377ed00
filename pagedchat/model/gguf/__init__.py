"""GGUF model files: reading, tokenizer, weights."""
