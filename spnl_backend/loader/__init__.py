"""Model name or path → weights, config and tokenizer → a built engine."""
