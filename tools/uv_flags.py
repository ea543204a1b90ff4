"""Print the ``uv pip install`` flags that match this machine's pip configuration, for ``make setup``.

uv installs the same packages as pip in a fraction of the time (parallel downloads and unpacking),
but it does not read pip's configuration files or ``PIP_*`` variables. ``make setup`` runs this
with the Python that creates the venv; it reads ``pip config list`` (files and environment) and
prints one line of flags: index URLs, find-links, constraints, with ``--compile-bytecode`` (pip
compiles on install; where ``PYTHONDONTWRITEBYTECODE`` is set nothing is compiled later, and the
suite ran 1.6x slower without it) and ``--index-strategy unsafe-best-match`` (pip picks the best
version over all indexes; uv's default stops at the first index that has the package). A CA bundle
set for pip (``cert``) is printed as ``SSL_CERT_FILE=<path>`` on a second line.

Exit status 1, with the reason on stderr, for a pip setting this does not translate (a proxy,
``no-index``, a client certificate, ...): ``make setup`` then installs with pip.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip option -> uv flag; values may hold several space-separated entries
_LISTS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
# pip options that change nothing about what is installed
_IGNORED = {
    "timeout",
    "default-timeout",
    "disable-pip-version-check",
    "no-cache-dir",
    "progress-bar",
    "quiet",
    "verbose",
    "no-input",
    "root-user-action",
    "no-warn-script-location",
}


class UnsupportedPipSetting(ValueError):
    """A pip setting with no uv flag here; ``make setup`` falls back to pip."""


def parse(listing: str) -> tuple[list[str], str | None]:
    """uv flags and the CA bundle (or None) from ``pip config list`` output
    (``section.option='value'`` lines; section ``global``, ``install``, ``:env:``, ...).

    Raises:
        UnsupportedPipSetting: an option that is neither translated nor known to be harmless.
    """
    flags: list[str] = []
    cert = None
    for line in listing.splitlines():
        if "=" not in line:
            continue
        key, _, raw = line.partition("=")
        option = key.rsplit(".", 1)[-1].strip()
        value = raw.strip().strip("'\"")
        if option in _LISTS:
            for item in value.split():
                if (_LISTS[option], item) not in zip(flags[::2], flags[1::2], strict=True):
                    flags += [_LISTS[option], item]
        elif option == "cert":
            cert = value
        elif option not in _IGNORED:
            raise UnsupportedPipSetting(f"pip setting {key.strip()!r} has no uv flag here")
    return flags, cert


def main() -> int:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    try:
        flags, cert = parse(listing)
    except UnsupportedPipSetting as e:
        print(f"uv_flags: {e}; installing with pip", file=sys.stderr)
        return 1
    flags += ["--compile-bytecode", "--index-strategy", "unsafe-best-match"]
    print(shlex.join(flags))
    if cert:
        print(f"SSL_CERT_FILE={shlex.quote(cert)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
