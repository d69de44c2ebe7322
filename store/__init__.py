"""Where bytes live: local and shared paths, gs:// and s3:// buckets, http(s):// files.

storage.py is the one seam every module calls (kvstores.py is its transport); chunk_store.py
and step_dirs.py are a checkpoint's chunks and step directories; offload.py takes a save's
state off the training loop's path (an on-device copy, then host); prefetch.py reads a
resume's checkpoint to host while the accelerator opens; download.py fetches URLs.
May import: errors.py only. Every layer above may import it (tests/test_layout.py).
"""
