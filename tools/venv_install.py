"""Install packages into a virtual environment with uv, or with pip where uv cannot.

    python3 tools/venv_install.py VENV [pip install arguments...]

uv installs the same versions as pip from the same sources, several times faster (speedkv's
own environment with empty caches, both in one run: 20 s against pip's 143 s). The Makefile's
environments go through here. uv reads no pip configuration, so the sources pip is configured with
(find-links, index URLs, constraints and its CA file; from pip.conf or PIP_* variables) are
handed to it, and several indexes are searched together as pip does. pip installs uv into
VENV the first time. Where uv cannot be had, or fails, pip runs the same command, and says so.

uv is asked to compile what it installs to bytecode, as pip does by default. uv's default writes
none, and where PYTHONDONTWRITEBYTECODE is set nothing writes it later, so every process would
compile torch, transformers and vLLM from source again: on 2 cores of a Zen 3 EPYC, `import
torch` took 6.5 s without bytecode and 3.5 s with it, vLLM's `LLM` 35 s and 15 s.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

# pip's configuration keys and the uv options that take the same values
LIST_OPTIONS = {
    "find-links": "--find-links",
    "extra-index-url": "--extra-index-url",
    "constraint": "--constraint",
}
SINGLE_OPTIONS = {"index-url": "--index-url"}
# `pip config list` prints its files' settings merged, as section.key; for `pip install` the
# [install] section overrides [global], and PIP_* variables (":env:") override both. Other
# sections belong to other pip commands.
PRECEDENCE = ["global", "install", ":env:"]
UV = "uv==0.13.9"  # the version these installs were checked with


def pip_configuration(python: str) -> dict[str, str]:
    """pip's effective settings: its files and PIP_* variables, as `pip config list` says."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"],
                            capture_output=True, text=True)  # fmt: skip
    return parse_pip_config(listed.stdout)


def parse_pip_config(listing: str) -> dict[str, str]:
    """`pip config list`'s lines (`global.find-links='/opt/wheels'`) as the settings `pip
    install` uses, one per name: the strongest section's where several set it."""
    found = []
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if section in PRECEDENCE:
            found.append((PRECEDENCE.index(section), name, value.strip().strip("'\"")))
    return {name: value for _, name, value in sorted(found, key=lambda item: item[0])}


def uv_sources(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's options and environment for pip's `settings`."""
    options: list[str] = []
    for name, flag in LIST_OPTIONS.items():
        for value in settings.get(name, "").split():
            options += [flag, value]
    for name, flag in SINGLE_OPTIONS.items():
        if settings.get(name):
            options += [flag, settings[name]]
    if "--extra-index-url" in options:
        # pip takes the best version from every index; uv's default stops at the first index
        # that has the package
        options += ["--index-strategy", "unsafe-best-match"]
    env = {"SSL_CERT_FILE": settings["cert"]} if settings.get("cert") else {}
    return options, env


def ensure_uv(venv: Path) -> Path | None:
    """The venv's uv, installed there by pip if missing; None if that fails."""
    uv = venv / "bin" / "uv"
    if not uv.exists():
        done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                               "--disable-pip-version-check", UV])  # fmt: skip
        if done.returncode != 0:
            return None
    return uv


def install(venv: Path, arguments: list[str]) -> int:
    python = str(venv / "bin" / "python")
    uv = ensure_uv(venv)
    if uv is not None:
        options, env = uv_sources(pip_configuration(python))
        command = [str(uv), "pip", "install", "--quiet", "--compile-bytecode", "--python", python,
                   *options, *arguments]  # fmt: skip
        if subprocess.run(command, env={**os.environ, **env}).returncode == 0:
            return 0
        print(f"uv could not install {shlex.join(arguments)}; pip will", file=sys.stderr)
    command = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    return subprocess.run([*command, *arguments]).returncode


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__.split("\n\n")[1].strip())
    sys.exit(install(Path(sys.argv[1]), sys.argv[2:]))


if __name__ == "__main__":
    main()
