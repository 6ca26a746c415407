"""Evaluation scripts (perplexity, needle in a haystack, kernel benchmarks); importable for the notebook."""
