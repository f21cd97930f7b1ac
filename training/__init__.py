"""MTP training, evaluation and corpora: run from the repository root, never packaged."""
