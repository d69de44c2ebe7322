"""Evaluation of our models: scoring, tasks, suites, comparison, plots (CLI: eval.py).

Offline suites and lm-eval-harness (eval.py), the in-loop held-out loss and olmo_eval
tasks, and the sample a run prints at its end (sample.py; train.py calls them).
May import: formats/, monitor/, configs/ and the layers below them (tests/test_layout.py).
"""
