"""What every launch/ entry point shares (issue #48 item 6): its parser, its input-path checks and
its progress bars, in one place.

* `parser(__doc__, __file__, EXAMPLE)`: argparse with the script's docstring as description, the
  command line a user would type (README.md / docs/*.md's, where the script appears there) as
  the epilog, and `python launch/NAME.py` as the program name in usage lines and errors.
* `checkpoint_dir`, `input_file`: argparse `type=`s for inputs. A missing path is refused while
  the command line is parsed, so before any model is built: `argument --checkpoint: DIR: no
  such directory` names both the flag and the path.
* `progress(...)`: a tqdm bar on stderr, off when stderr is not a terminal (logs, CI, pytest's
  capture stay clean); `echo(...)`: print() for stdout lines written while a bar is drawn (the
  bar is cleared and redrawn around the line, the line itself is what print() writes).
* `load_model(DIR, dtype)`: `quality.train.load_model` with a bar, one step per stored tensor.

argparse, not absl.flags: see WORKSPACE.md ("Decisions").
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def parser(doc: str | None, file: str, *examples: str, **kw) -> argparse.ArgumentParser:
    """The script's parser: `doc` above the options, `examples` (one command each) below them."""
    if not examples:
        raise ValueError(f"{file}: a launch script's --help shows at least one example command")
    epilog = ("example:\n" if len(examples) == 1 else "examples:\n") + "\n".join(f"  {e}" for e in examples)
    return argparse.ArgumentParser(prog=f"python launch/{Path(file).name}", description=doc, epilog=epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter, **kw)


def input_file(text: str) -> str:
    """argparse type: a file that must exist."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text}: " + ("a directory, not a file" if os.path.isdir(text)
                                                         else "no such file"))
    return text


def profile_arg(text: str) -> str:
    """argparse type of --profile: a preset's name (reuse.profile.NAMES), else (a name ending in
    .json or holding a path separator) a profile file that must exist."""
    return input_file(text) if text.endswith(".json") or os.sep in text else text


def checkpoint_dir(text: str) -> str:
    """argparse type: a checkpoint directory, i.e. one holding config.json."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text} has no config.json (not a checkpoint directory)")
    return text


def progress(iterable=None, desc: str | None = None, total: int | None = None, unit: str = "it",
             off: bool = False, **kw):
    """A tqdm bar on stderr; `off`, or stderr not a terminal, draws nothing (the iterable passes
    through unchanged)."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, disable=True if off else None,
                dynamic_ncols=True, **kw)


def echo(*parts, sep: str = " ") -> None:
    """print(*parts) to stdout, flushed, without tearing a progress bar drawn on the terminal."""
    from tqdm import tqdm

    out = sys.stdout
    tqdm.write(sep.join(map(str, parts)), file=out)
    out.flush()


def load_model(directory, dtype):
    """`quality.train.load_model` (any safetensors checkpoint with config.json) with a bar over
    the stored tensors."""
    from redknot_jax.quality.train import load_model as load

    return load(directory, dtype, progress=lambda keys: progress(keys, desc=f"load {Path(directory).name}",
                                                                  unit="tensor"))
