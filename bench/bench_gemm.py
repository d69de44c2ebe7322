"""Where the CPU train step's time goes: its matmuls, XLA vs PyTorch, shape by shape.

bench/bench_train.py gives one ratio for the whole step. This takes the
matmuls of that step (the same peer model: 4 layers, d_model 512, MLP 1408,
vocabulary 32,000, 8 x 512 tokens, float32), each in the three orientations a
training step runs it (forward y = x w; input gradient dx = dy w^T; weight
gradient dw = x^T dy), and times every one with XLA (jitted, as our step
compiles it) and with torch (what transformers' step calls), interleaved
round by round, best of `--rounds`. It prints GFLOP/s per matmul and side,
and both sides' total time weighted by how often the step runs each matmul:
the share of the step that matmul-kernel speed alone explains.

  python bench/bench_gemm.py [--rounds=5]

Shapes: M tokens (B*T), D d_model, F MLP hidden, V vocabulary.
"""

import argparse
import os
import time

os.environ.pop('XLA_FLAGS', None)  # one real CPU device

import jax  # pylint: disable=g-import-not-at-top
import numpy as np

M, D, F, V, LAYERS = 8 * 512, 512, 1408, 32000, 4

# (name, [in, out] of the weight, uses per step): q, k, v, o are four D x D
# matmuls per layer, gate and up two D x F, down one F x D; the head once.
MATMULS = [('attention q/k/v/o', (D, D), 4 * LAYERS), ('MLP gate/up', (D, F), 2 * LAYERS),
           ('MLP down', (F, D), LAYERS), ('LM head', (D, V), 1)]


def operands(shape: tuple[int, int], kind: str, rng: np.random.Generator):
  """The two float32 operands of one orientation, laid out as a step holds them."""
  i, o = shape
  x, w, dy = (rng.standard_normal(s, np.float32) for s in ((M, i), (i, o), (M, o)))
  return {'fwd': (x, w), 'dx': (dy, w), 'dw': (x, dy)}[kind]


def xla_fn(kind: str):
  return jax.jit({'fwd': lambda a, b: a @ b, 'dx': lambda a, b: a @ b.T,
                  'dw': lambda a, b: a.T @ b}[kind])


def torch_fn(torch, kind: str):
  return {'fwd': lambda a, b: a @ b, 'dx': lambda a, b: a @ b.T,
          'dw': lambda a, b: a.T @ b}[kind]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rounds', type=int, default=5)
  args = parser.parse_args()
  import torch  # pylint: disable=g-import-not-at-top
  print(f'load average before: {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}')
  rng = np.random.default_rng(0)
  rows, total = [], {'xla': 0.0, 'torch': 0.0}
  for name, shape, uses in MATMULS:
    for kind in ('fwd', 'dx', 'dw'):
      a, b = operands(shape, kind, rng)
      ja, jb = jax.device_put(a), jax.device_put(b)
      ta, tb = torch.from_numpy(a), torch.from_numpy(b)
      fx, ft = xla_fn(kind), torch_fn(torch, kind)
      fx(ja, jb).block_until_ready()
      ft(ta, tb)
      best = {'xla': float('inf'), 'torch': float('inf')}
      for _ in range(args.rounds):
        start = time.perf_counter()
        fx(ja, jb).block_until_ready()
        best['xla'] = min(best['xla'], time.perf_counter() - start)
        start = time.perf_counter()
        ft(ta, tb)
        best['torch'] = min(best['torch'], time.perf_counter() - start)
      flops = 2 * M * shape[0] * shape[1]
      for side in total:
        total[side] += uses * best[side]
      rows.append((f'{name} {kind}', uses, flops / best['xla'] / 1e9,
                   flops / best['torch'] / 1e9, best['torch'] / best['xla']))
  print(f'{"matmul":26s} {"per step":>8s} {"XLA GFLOP/s":>12s} {"torch GFLOP/s":>14s} '
        f'{"XLA/torch speed":>16s}')
  for name, uses, gx, gt, ratio in rows:
    print(f'{name:26s} {uses:8d} {gx:12.1f} {gt:14.1f} {ratio:16.2f}')
  print(f'all matmuls of one step: XLA {total["xla"]:.2f} s, torch {total["torch"]:.2f} s, '
        f'XLA/torch speed {total["torch"] / total["xla"]:.2f}')
  print(f'load average after: {os.getloadavg()[0]:.2f}')


if __name__ == '__main__':
  main()
