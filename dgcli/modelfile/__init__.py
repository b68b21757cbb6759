"""GGUF files read without loading them: the header (header.py), the hyperparameters the Gemma 4
family's loaders read (hparams.py), and what a file holds and whether it fits this machine (info.py)."""
