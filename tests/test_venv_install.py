"""tools/venv_install.py hands uv the package sources pip is configured with."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from helpers import load_script

ROOT = Path(__file__).resolve().parent.parent

installer = load_script("tools", "venv_install")

LISTING = """\
:env:.find-links='/env/wheels'
download.index-url='https://download.example/simple'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
global.timeout='30'
install.timeout='60'
"""


def test_pip_installs_settings_are_read_as_pip_install_reads_them():
    settings = installer.parse_pip_config(LISTING)
    assert settings["find-links"] == "/env/wheels"  # PIP_FIND_LINKS over pip.conf
    assert settings["extra-index-url"] == "file:///opt/pypi/simple file:///opt/pypi-more/simple"
    assert settings["timeout"] == "60"  # [install] over [global]
    assert "index-url" not in settings  # [download] is another command's


def test_uv_gets_pips_sources_constraints_and_ca_file():
    options, env = installer.uv_sources(installer.parse_pip_config(LISTING))
    assert options == [
        "--find-links", "/env/wheels",
        "--extra-index-url", "file:///opt/pypi/simple",
        "--extra-index-url", "file:///opt/pypi-more/simple",
        "--constraint", "/etc/xdg/pip/constraints.txt",
        "--index-strategy", "unsafe-best-match",  # every index searched, as pip does
    ]  # fmt: skip
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}


def test_no_pip_configuration_means_uvs_defaults():
    assert installer.uv_sources(installer.parse_pip_config("")) == ([], {})


def test_bytecode_compiles_every_module_of_the_environment_and_passes_over_bad_ones(tmp_path):
    """`--bytecode` leaves a .pyc beside each module of VENV's site-packages, even where
    PYTHONDONTWRITEBYTECODE is set, and a file in another Python's syntax stops nothing."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    relative = Path(sysconfig.get_paths()["purelib"]).relative_to(sysconfig.get_paths()["data"])
    package = venv / relative / "somepackage"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 1\n")
    (package / "newer_syntax.py").write_text("def f[T](a):\n    return a\n")  # 3.12's generics
    (package / "ok.py").write_text("import somepackage\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "venv_install.py"), "--bytecode",
                           str(venv)], env=env, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    compiled = {path.name.split(".")[0] for path in (package / "__pycache__").glob("*.pyc")}
    assert compiled == {"__init__", "ok"}
