"""How a command's bad input must fail: exit code 2 (click's usage errors and ggufspec's), no traceback, and
on stderr one line "ggufspec: error: ..." naming what was wrong; and `ggufspec run` on a pair as the load
flags' tests call it, with or without bad flags."""
from click.testing import CliRunner

from ggufspec.cli import main


def run_pair(pair, *flags, n_predict: int = 8, n_ctx: int = 256):
    """`ggufspec run` of (target, draft) `pair`, greedy, --json, FLAGS last: click's result."""
    target, draft = pair
    return CliRunner().invoke(main, ["run", "-m", str(target), "-md", str(draft), "-p", "the cat sat", "-n",
                                     str(n_predict), "-c", str(n_ctx), "-t", "1", "--temp", "0", "--json", *flags],
                              input="")


def one_line_error(result, *words, code: int = 2) -> str:
    """`result` of click's CliRunner; each of `words` must be in the line, which is returned."""
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    line = result.stderr.strip()
    assert line.startswith("ggufspec: error:") and "\n" not in line, result.stderr
    assert "Traceback" not in result.output, result.output
    for word in words:
        assert word in line, line
    return line
