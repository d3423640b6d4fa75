"""The `ggufspec` command line: results on stdout, progress, logs and statistics on stderr.

    app.py       the group, --version, errors as one line and an exit code
    options.py   the flags several commands share, and opening a Session from them
    generate.py  run, chat, serve, bench, eval: thin layers over one SpeculativeDecoder
    models.py    pull, list, rm, plan, worker
"""
from . import generate, models  # noqa: F401  (registers the commands)
from .app import main
from .options import process_escapes

__all__ = ["main", "process_escapes"]
