"""tools/venv_install.py hands uv the package sources pip is configured with."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from helpers import load_script

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


def wheel_of(folder: Path, files: dict[str, str]) -> Path:
    """A pure-Python wheel holding `files` (path inside the wheel: text), built by hand."""
    name = "somepackage-1.0"
    info = {
        f"{name}.dist-info/METADATA": "Metadata-Version: 2.1\nName: somepackage\nVersion: 1.0\n",
        f"{name}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    wheel = folder / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in {**files, **info}.items():
            data = text.encode()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{path},sha256={digest},{len(data)}")
            archive.writestr(path, data)
        record.append(f"{name}.dist-info/RECORD,,")
        archive.writestr(f"{name}.dist-info/RECORD", "\n".join(record) + "\n")
    return wheel


def test_uv_installs_bytecode_even_where_python_would_write_none(tmp_path, monkeypatch):
    """What uv installs comes with its .pyc files, as pip's does, where PYTHONDONTWRITEBYTECODE
    is set; a module in a newer Python's syntax does not stop the install."""
    uv = Path(sys.executable).parent / "uv"
    if not uv.exists():
        pytest.skip("no uv in this environment")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (venv / "bin" / "uv").symlink_to(uv)
    wheel = wheel_of(tmp_path, {
        "somepackage/__init__.py": "VALUE = 1\n",
        "somepackage/newer_syntax.py": "def f[T](a):\n    return a\n",  # 3.12's generics
    })  # fmt: skip
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert installer.install(venv, ["--no-deps", str(wheel)]) == 0
    relative = Path(sysconfig.get_paths()["purelib"]).relative_to(sysconfig.get_paths()["data"])
    cache = venv / relative / "somepackage" / "__pycache__"
    assert {path.name.split(".")[0] for path in cache.glob("*.pyc")} == {"__init__"}
