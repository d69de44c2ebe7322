"""The reproduction in miniature (scripts/reproduce_olmo_core.py): our side of the run.

configs/small.py's tiny Olmo 3 at half width (4 layers, d_model 128, 4 heads,
MLP 384, 3 sliding layers with window 64 then 1 full, sequence 128, the
embedded 8192 token vocabulary), float32, with a global batch of 8 x 128 and a
warmup + cosine recipe short enough to train a few hundred steps on two CPU
cores. The script builds OLMo-core's model, optimizer and scheduler from the
same fields, so the two sides cannot drift apart; the step-0 weights come from
OLMo-core's init through `train.init_from` (an HF directory the script writes).
"""

import os

import ml_collections

from configs import small


def get_config() -> ml_collections.ConfigDict:
  c = small.get_config()
  # The shape the noise ensemble was validated on (docs/results/reproduction.md):
  # small.py's 4 layers 'SSSF' and 4 heads, at half its width and sequence, so
  # the whole ensemble of one seed trains in minutes on two cores.
  c.model.d_model, c.model.head_dim, c.model.mlp_hidden = 128, 32, 384
  c.data.seq_len = 128
  # OLMo-core 3.0.0 turns a window W into flash-attn's (W-1, 0): query i sees
  # (i-W, i], W keys, the HF semantics; so the plus-one knob stays off.
  c.model.sliding_window = 64
  c.model.sliding_window_plus_one = False

  # The embedded corpus as explicit files and ids: the script hands the same list
  # and ids to OLMo-core's NumpyFSLDataset, which reads no mix header.
  d = c.data
  d.mix_file = ''
  d.paths = (os.path.join(small.DATA_DIR, 'shakespeare-train-00000.npy'),)
  d.validation_paths = (os.path.join(small.DATA_DIR, 'shakespeare-validation-00000.npy'),)
  d.tokenizer = os.path.join(small.DATA_DIR, 'tokenizer.json')
  d.vocab_size, d.eos_token_id, d.pad_token_id = 8192, 0, 1  # data/tokenizer.json
  c.model.vocab_size = 8192  # already a multiple of 128
  d.global_batch_size = 8  # 8 x 128 = 1024 tokens per step
  d.seed = 34521  # OLMo-core pretrain-1 data seed; both sides shuffle with PCG64(seed + 1)
  d.prefetch = 2

  o = c.opt
  o.lr = 3e-3  # configs/small.py's LR
  o.final_lr = 3e-4  # OLMo-core CosWithWarmup alpha_f = 0.1
  o.schedule = 'cosine'  # OLMo-core CosWithWarmup
  o.warmup_steps = 20
  o.t_max = 200  # the cosine ends with the run (CosWithWarmup t_max = trainer max_steps)

  t = c.train
  t.steps = 200
  t.micro_batch_size = 8  # one micro-batch: OLMo-core's loop below does not split either
  t.log_every = 50
  t.ckpt_every = 200  # only the final state is read back
  t.keep_last = 1
  t.eval_every = 0  # the script evaluates both final models on the same held-out batches
  t.eval_tasks = ()  # and compares losses only: no downstream evals in its many runs
  return c
