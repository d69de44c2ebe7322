"""Evaluation of our models: scoring, tasks, suites, comparison, plots (CLI: eval.py)."""
