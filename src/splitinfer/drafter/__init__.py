"""Training the learned draft head (model/drafthead.py) from the model's own continuations of offline text."""
