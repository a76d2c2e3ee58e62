"""Model name or path → weights, config and tokenizer: a `LoadedModel` (`model.load_model`)."""
