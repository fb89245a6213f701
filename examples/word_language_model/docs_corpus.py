"""The language model's data, from text this checkout has (no download): the corpus, and its token
streams as windows a shmlearn run draws batches from. This is the port's data change
(examples/language_model.py, docs/ports.md), kept out of the port.

pytorch/examples' word_language_model reads a folder holding train.txt, valid.txt and test.txt
(Wikitext-2). `build()` writes such a folder from this project's own prose, README.md and
docs/*.md, so that data.py's Corpus reads it unchanged:

* tokens as Wikitext and the Penn Treebank have them: lower case, punctuation split off, numbers
  as N, words seen fewer than MIN_COUNT times in the whole text as <unk> (at the time of writing:
  about 80 k tokens, 1.5 k distinct; without this, 10.7 k distinct words, 7 k of them seen once,
  and the softmax over them would cost the CPU most of each step);
* deterministic: the files in name order (README.md first), their non-blank lines in order; of
  every ten, the 9th goes to valid.txt, the 10th to test.txt, the other eight to train.txt (80/10/10);
* one folder per content: <tempdir>/shmlearn-lm-corpus-<sha256 of the three texts, 12 hex>, written
  once (each file written aside and renamed, so ranks that build it at once never read half a file);
  the same checkout always gives the same folder, an edited doc a new one.
"""
import collections
import glob
import hashlib
import os
import re
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The checkout: examples/word_language_model/ is two levels below it."""
SPLITS = ("train", "valid", "test")


MIN_COUNT = 3
TOKEN = re.compile(r"[a-z]+|[0-9]+(?:\.[0-9]+)?|[^\sa-z0-9]")
"""A word, a number (3 or 2.5) or one other visible character, in lower-cased text."""


def docs_lines(root=ROOT):
    """The non-blank lines of README.md and docs/*.md, in that order, as lists of tokens."""
    files = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    missing = [f for f in files if not os.path.isfile(f)]
    if missing or len(files) < 2:
        raise FileNotFoundError(f"the corpus is built from README.md and docs/*.md of a shmlearn checkout; "
                                f"{root} lacks {missing[0] if missing else 'docs/*.md'}")
    lines = []
    for path in files:
        with open(path, encoding="utf8") as f:
            lines.extend(["N" if t[0].isdigit() else t for t in TOKEN.findall(line.lower())]
                         for line in f if line.strip())
    counts = collections.Counter(t for line in lines for t in line)
    return [" ".join(t if counts[t] >= MIN_COUNT else "<unk>" for t in line) for line in lines]


def split(lines):
    """{split: text}: of every ten lines the 9th is valid, the 10th test, the rest train."""
    parts = {name: [] for name in SPLITS}
    for i, line in enumerate(lines):
        parts["valid" if i % 10 == 8 else "test" if i % 10 == 9 else "train"].append(line)
    return {name: "\n".join(part) + "\n" for name, part in parts.items()}


def build(root=ROOT, base=None):
    """The folder holding train.txt, valid.txt and test.txt; written if absent (a few ms when
    present: the docs are read and hashed)."""
    texts = split(docs_lines(root))
    digest = hashlib.sha256("\0".join(texts[n] for n in SPLITS).encode()).hexdigest()[:12]
    folder = os.path.join(base or tempfile.gettempdir(), f"shmlearn-lm-corpus-{digest}")
    os.makedirs(folder, exist_ok=True)
    for name in SPLITS:
        path = os.path.join(folder, f"{name}.txt")
        if not os.path.isfile(path):
            aside = f"{path}.{os.getpid()}.tmp"
            with open(aside, "w", encoding="utf8") as f:
                f.write(texts[name])
            os.replace(aside, path)
    return folder


def windows(ids, bptt):
    """A token stream (int64, as data.Corpus gives it) as a map-style Dataset of (input, target)
    pairs, each int64 [bptt]: the stream cut into consecutive windows of bptt tokens, the target
    the input shifted by one token (the original's get_batch; a last partial window is dropped)."""
    n = (len(ids) - 1) // bptt
    if n < 1:
        raise ValueError(f"a stream of {len(ids)} tokens holds no window of {bptt} + 1 tokens")
    return torch.utils.data.TensorDataset(ids[:n * bptt].view(n, bptt), ids[1:n * bptt + 1].view(n, bptt))
