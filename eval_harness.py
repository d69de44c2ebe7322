"""An lm-eval-harness `LM` for our models, so `lm_eval` runs its tasks against our checkpoints.

    python eval_harness.py --checkpoint=DIR --tasks=hellaswag,arc_easy --limit=N \
        [--include_path=DIR_OF_TASK_YAMLS] [--output=results.json]

or from Python: `lm_eval.simple_evaluate(model=OlmoLM('DIR'), tasks=[...])`;
`--model olmo3_jax` also works for any code that has imported this module.
Tokenization is lm-eval's own (`TemplateLM`); scoring goes through
eval_scoring.Scorer, the same packed scorer as eval.py, so both report the
same numbers for the same task. Generation is greedy (no sampling).
"""

from collections.abc import Sequence

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                  postprocess_generated_text)

import eval_scoring


@register_model('olmo3_jax')
class OlmoLM(TemplateLM):
  """A checkpoint or HF directory (or an already loaded model) as an lm-eval `LM`."""

  def __init__(self, checkpoint: str | None = None, *, lm: eval_scoring.LoadedModel | None = None,
               tokenizer: str | None = None, step: int | None = None, dtype: str = 'float32',
               max_length: int | None = None, batch_tokens: int = 16384, max_gen_toks: int = 256,
               batch_size=None, max_batch_size=None, device=None):
    """batch_size, max_batch_size and device are what lm_eval passes every model; the
    scorer sizes its own batches (batch_tokens) and runs on JAX's default device."""
    del batch_size, max_batch_size, device
    super().__init__()
    if (checkpoint is None) == (lm is None):
      raise ValueError('OlmoLM needs exactly one of checkpoint=DIR or lm=LoadedModel.')
    self.lm = lm or eval_scoring.load_model(checkpoint, step=int(step) if step else None,
                                            dtype=dtype, max_length=max_length and int(max_length))
    self.tokenizer = eval_scoring.load_tokenizer(tokenizer, self.lm)
    self.scorer = eval_scoring.Scorer(self.lm, batch_tokens=int(batch_tokens))
    self._max_gen_toks = int(max_gen_toks)

  @property
  def eot_token_id(self) -> int:
    return self.lm.eos_token_id

  @property
  def max_length(self) -> int:
    return self.lm.max_length

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    # Olmo 3 has no BOS; documents are only separated by EOS, so nothing is added.
    return self.tokenizer.encode(string, add_special_tokens=False).ids

  def tok_decode(self, tokens: Sequence[int] | int, skip_special_tokens: bool = True) -> str:
    tokens = [tokens] if isinstance(tokens, int) else list(tokens)
    return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                            ) -> list[tuple[float, bool]]:
    results = self.scorer.loglikelihood_tokens([(ctx, cont) for _, ctx, cont in requests])
    for (key, _, _), result in zip(requests, results):
      self.cache_hook.add_partial('loglikelihood', key, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    docs = [self.tok_encode(req.args[0]) for req in requests]
    results = [-nll for nll in self.scorer.rolling_nll(docs)]
    for req, result in zip(requests, results):
      self.cache_hook.add_partial('loglikelihood_rolling', (req.args[0],), result)
    return results

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Greedy decoding to max_gen_toks, cut at the first stop string (lm-eval HFLM's rules)."""
    eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
    groups: dict[tuple, list[tuple[int, list[int]]]] = {}
    for i, req in enumerate(requests):
      context, gen_kwargs = req.args
      kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
      if kwargs.get('do_sample') or kwargs.get('temperature', 0.0) > 0.0:
        raise ValueError(f'OlmoLM decodes greedily; the task asks for sampling ({gen_kwargs}).')
      until = handle_stop_sequences(kwargs.pop('until', None), eos=eos)
      max_gen = kwargs.pop('max_gen_toks')
      if max_gen >= self.max_length:
        raise ValueError(f'max_gen_toks={max_gen} leaves no room for context within '
                         f'max_length={self.max_length}.')
      prompt = self.tok_encode(context)[-(self.max_length - max_gen):]
      groups.setdefault((tuple(until), max_gen), []).append((i, prompt))
    out = [''] * len(requests)
    for (until, max_gen), members in groups.items():
      def stop(new, until=until):
        text = self.tok_decode(new)
        return any(s and s in text for s in until)
      generated = self.scorer.generate([p for _, p in members], max_gen, stop)
      for (i, _), new in zip(members, generated):
        out[i] = postprocess_generated_text(generation=self.tok_decode(new), stop=list(until),
                                            think_end_token=None)
        self.cache_hook.add_partial('generate_until', requests[i].args, out[i])
    return out


def main(argv: Sequence[str]) -> None:
  import json

  import lm_eval
  from lm_eval.tasks import TaskManager
  del argv
  manager = TaskManager(include_path=FLAGS.include_path or None,
                        include_defaults=not FLAGS.only_included)
  results = lm_eval.simple_evaluate(
      model=OlmoLM(FLAGS.checkpoint, tokenizer=FLAGS.tokenizer, step=FLAGS.step,
                   dtype=FLAGS.dtype, max_length=FLAGS.max_length),
      tasks=FLAGS.tasks, num_fewshot=FLAGS.num_fewshot, limit=FLAGS.limit,
      task_manager=manager, log_samples=False)
  for task, metrics in results['results'].items():
    print(task, {k: v for k, v in metrics.items() if isinstance(v, float)})
  if FLAGS.output:
    with open(FLAGS.output, 'w') as f:
      json.dump(results['results'], f, indent=1, default=str)


if __name__ == '__main__':
  from absl import app, flags
  flags.DEFINE_string('checkpoint', None, 'HF directory or our checkpoint directory.',
                      required=True)
  flags.DEFINE_list('tasks', None, 'lm-eval task names.', required=True)
  flags.DEFINE_string('include_path', None, 'Folder of extra task YAMLs (e.g. offline copies).')
  flags.DEFINE_bool('only_included', False, 'Index only --include_path (faster start).')
  flags.DEFINE_integer('limit', None, 'Documents per task.')
  flags.DEFINE_integer('num_fewshot', None, "Override the tasks' few-shot count.")
  flags.DEFINE_string('tokenizer', None, 'tokenizer.json (default: beside the model, or data/).')
  flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
  flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Compute dtype.')
  flags.DEFINE_integer('max_length', None, 'Longest scored input.')
  flags.DEFINE_string('output', None, 'Where to write the results JSON.')
  FLAGS = flags.FLAGS
  app.run(main)
