"""Text before a model: the tokenizer cut rule and the encoder that
tokenizes texts before they are queued (no torch)."""
