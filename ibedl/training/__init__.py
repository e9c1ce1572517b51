"""Training: datasets, fine-tuning methods and their configurations."""
