"""make setup's uv flags: this machine's pip settings (files and PIP_* variables, as `pip config
list` prints them) become the same indexes, find-links and constraints for uv, and a setting with
no uv equivalent makes setup install with pip instead."""

import subprocess
import sys

import pytest

from tools.uv_flags import UnsupportedPipSetting, parse

LISTING = """\
:env:.cert='/etc/ssl/certs/ca.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.find-links='/opt/wheels'
"""


def test_pip_settings_become_uv_flags():
    flags, cert = parse(LISTING)
    pairs = list(zip(flags[::2], flags[1::2], strict=True))
    assert pairs == [
        ("--find-links", "/opt/wheels"),  # once, though set in two places
        ("--constraint", "/etc/xdg/pip/constraints.txt"),
        ("--extra-index-url", "file:///opt/a/simple"),
        ("--extra-index-url", "file:///opt/b/simple"),
    ]
    assert cert == "/etc/ssl/certs/ca.crt"
    assert parse("") == ([], None)


@pytest.mark.parametrize("line", ["global.proxy='http://p:3128'", "install.no-index='true'"])
def test_a_setting_uv_is_not_given_falls_back_to_pip(line):
    with pytest.raises(UnsupportedPipSetting, match="no uv flag"):
        parse(LISTING + line)


def test_the_script_prints_one_line_of_flags_that_compile_bytecode():
    out = subprocess.run(
        [sys.executable, "tools/uv_flags.py"], capture_output=True, text=True, check=False
    )
    if out.returncode == 1:  # this machine's pip has a setting uv is not given: pip installs
        assert "installing with pip" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    flags = out.stdout.splitlines()[0].split()
    assert "--compile-bytecode" in flags and "unsafe-best-match" in flags
