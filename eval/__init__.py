"""Quality evaluation scripts (perplexity, needle in a haystack, lm-eval tasks); importable for the notebook."""
