"""Reading tasks' training data: rows from disk, rendered and tokenized into examples."""
