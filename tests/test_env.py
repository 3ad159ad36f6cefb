"""ulysses_kernels.env: the one parser of boolean and numeric environment variables."""

import pytest

from ulysses_kernels import env

NAME = "ULYSSES_KERNELS_TEST_SWITCH"


@pytest.mark.parametrize("raw", ["1", "true", "yes", "on", "y", "TRUE", " True ", "Yes", "ON", "Y"])
def test_flag_true_spellings(raw, monkeypatch):
    monkeypatch.setenv(NAME, raw)
    assert env.flag(NAME) is True
    assert env.flag(NAME, default=False) is True


@pytest.mark.parametrize("raw", ["0", "false", "no", "off", "n", "FALSE", " 0 ", "Off", "N"])
def test_flag_false_spellings(raw, monkeypatch):
    monkeypatch.setenv(NAME, raw)
    assert env.flag(NAME) is False
    assert env.flag(NAME, default=True) is False


@pytest.mark.parametrize("raw", [None, "", "  "])
def test_flag_default_when_unset_or_empty(raw, monkeypatch):
    if raw is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, raw)
    assert env.flag(NAME) is False
    assert env.flag(NAME, default=True) is True


@pytest.mark.parametrize("raw", ["2", "maybe", "tru", "-1", "enabled"])
def test_flag_invalid_value_names_the_variable(raw, monkeypatch):
    monkeypatch.setenv(NAME, raw)
    with pytest.raises(ValueError, match=f"{NAME}={raw!r} is not a boolean") as info:
        env.flag(NAME)
    assert "true" in str(info.value) and "false" in str(info.value)  # the accepted spellings


def test_number(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env.number(NAME, 600.0) == 600.0
    monkeypatch.setenv(NAME, "  ")
    assert env.number(NAME, 3.0) == 3.0  # empty means unset
    monkeypatch.setenv(NAME, "2.5")
    assert env.number(NAME, 600.0) == 2.5
    monkeypatch.setenv(NAME, "10")
    assert env.number(NAME, 600.0) == 10.0
    monkeypatch.setenv(NAME, "ten")
    with pytest.raises(ValueError, match=f"{NAME}='ten' is not a number"):
        env.number(NAME, 600.0)


def test_interpreting_reads_triton_interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert env.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "false")  # "false" means off, not "a non-empty string"
    assert not env.interpreting()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not env.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "sure")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        env.interpreting()
