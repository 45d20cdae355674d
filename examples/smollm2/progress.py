"""Progress bars: tqdm when it is installed, else a plain stand-in (the
program does not need tqdm to run)."""

from __future__ import annotations

import sys

try:
    from tqdm import tqdm
except ImportError:  # a plain stand-in: the program does not need tqdm to run

    def tqdm(iterable=None, total=None, desc="", disable=False, **_):
        return iterable if iterable is not None else _Bar(total, desc, disable)

    class _Bar:
        def __init__(self, total, desc, disable):
            self.total, self.n, self.desc, self.disable = total, 0, desc, disable

        def update(self, k=1):
            self.n += k
            if not self.disable:
                print(f"\r{self.desc} {self.n}/{self.total}", end="", file=sys.stderr, flush=True)

        def close(self):
            if not self.disable:
                print(file=sys.stderr)
