"""Model name or path → weights, config and tokenizer: a `LoadedModel` (`build.load_model`)."""
