"""A small Olmo 3 for CPU: the README's main job on the embedded Shakespeare corpus.

Same architecture and recipe shape as configs/olmo3_7b.py (reordered norms,
QK-norm, 3:1 sliding/full, AdamW + skip-step, z-loss), shrunk to train in a
few minutes on two CPU cores.
"""

import os

import ml_collections
from ml_collections import config_dict

from configs import olmo3_7b

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'data')


def get_config() -> ml_collections.ConfigDict:
  c = olmo3_7b.get_config()
  m = c.model
  # None: data.vocab_size padded to a multiple of 128 (config_checks.complete), as Ai2 pads
  # dolma2's 100,278 to 100,352; so it follows whatever mix --config.data.mix_file names.
  m.vocab_size = config_dict.placeholder(int)
  m.num_layers = 4  # one scan group of the 3:1 pattern
  m.d_model = 256
  m.num_heads = 4
  m.num_kv_heads = 4
  m.head_dim = 64
  m.mlp_hidden = 768
  m.sliding_window = 64  # smaller than seq_len so the window matters
  m.dtype = 'float32'  # CPUs have no fast bf16 matmul
  m.remat = 'none'  # activations are small; recompute would only cost time

  d = c.data
  d.mix_file = os.path.join(DATA_DIR, 'shakespeare-train.txt')
  # The tokenizer's settings and the held-out set come from the mix's own `# tokenizer`
  # and `# validation` lines (data/README.md; config_checks.complete): the embedded BPE
  # (8192 tokens, EOS 0, PAD 1) and the held-out plays here, and whatever another mix
  # (scripts/prepare_data.py output) says when --config.data.mix_file names it.
  d.vocab_size = config_dict.placeholder(int)
  d.eos_token_id = config_dict.placeholder(int)
  d.pad_token_id = config_dict.placeholder(int)
  d.seq_len = 256
  # 8 x 256 for 300 steps beats 16 x 256 for 150 at the same tokens and time:
  # held-out CE 5.07 vs 5.26 (docs/results/small_run.md); the model is far below
  # its critical batch size, so twice the updates are worth more than less noise.
  d.global_batch_size = 8
  d.seed = 34521  # same data seed as the 7B recipe
  d.validation_batches = 16  # 16 x 8 = the first 128 held-out instances

  o = c.opt
  o.lr = 3e-3  # small models tolerate (and need) a larger LR
  o.schedule = 'cosine'
  o.warmup_steps = 30
  o.t_max = 300
  o.final_lr = 3e-4

  t = c.train
  t.steps = 300  # 614k tokens (~0.4 epoch): minutes on two cores
  t.micro_batch_size = 8
  t.log_every = 10
  t.ckpt_every = 100
  t.keep_every = 0
  t.eval_every = 50
  # Downstream evals (configs/olmo3_7b.py has OLMo-core's 26): four of them, each task's
  # first 20 documents (19k tokens in 10 forwards of 8 x 256: about two training steps'
  # time), at steps 150 and 300: OLMES ARC-Easy as BPB and as fast MC, basic-skills
  # arithmetic (RC), copycolors (fast MC). Their answers are at most 22 tokens here, so any
  # data.seq_len >= 22 scores them.
  t.eval_tasks = ('arc_easy_test_bpb_5shot', 'arc_easy_test_mc_5shot_fast',
                  'basic_skills_arithmetic_rc_5shot', 'copycolors_10way_fast')
  t.downstream_eval_every = 150
  t.downstream_eval_limit = 20
  return c
