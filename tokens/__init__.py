"""Token files and what is read from them: mixes, instances, packing, batches, the tokenizer.

token_files.py (mixes, file checks, memory maps; remote_tokens.py reads by byte range),
packed.py (the stage-3 packed dataset), batches.py (a batch from instances, split over ranks,
hosts and micro-batches), skips.py (skipped windows), run_tokenizer.py (the run's tokenizer).
data.py, above, builds OLMo-core's order over them.
May import: model.py, loss.py, optim.py, store/, kernels/, errors.py (tests/test_layout.py).
"""
