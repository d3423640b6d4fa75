"""Where the store is: GGUFSPEC_HOME (or XDG_DATA_HOME) as a shell leaves it, `~`, `$VARS` or a relative path,
is one folder whichever folder a command runs in."""

import pytest

from ggufspec.home import home


@pytest.mark.parametrize("setting, expected", [("~/gg", "HOME/gg"), ("$STORE_ROOT/gg", "ROOT/gg"), ("gg", "CWD/gg"),
                                                ("./a/../gg", "CWD/gg")])
def test_ggufspec_home_is_expanded_and_absolute(monkeypatch, tmp_path, setting, expected):
    user, root, cwd = (tmp_path / name for name in ("user", "root", "cwd"))
    for folder in (user, root, cwd):
        folder.mkdir()
    monkeypatch.setenv("HOME", str(user))
    monkeypatch.setenv("STORE_ROOT", str(root))
    monkeypatch.setenv("GGUFSPEC_HOME", setting)
    monkeypatch.chdir(cwd)
    want = expected.replace("HOME", str(user)).replace("ROOT", str(root)).replace("CWD", str(cwd))
    assert str(home()) == want


def test_a_relative_xdg_data_home_is_made_absolute(monkeypatch, tmp_path):
    monkeypatch.delenv("GGUFSPEC_HOME")
    monkeypatch.setenv("XDG_DATA_HOME", "~/data")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert home() == tmp_path / "data" / "ggufspec"
    monkeypatch.setenv("XDG_DATA_HOME", "data")
    monkeypatch.chdir(tmp_path)
    assert home() == tmp_path / "data" / "ggufspec" and home().is_absolute()
