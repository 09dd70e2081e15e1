"""What is a model's own: its spec, prompt rule and modules, as data the shared stages read."""
