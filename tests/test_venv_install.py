"""tools/venv_install.py hands uv the package sources pip is configured with."""

from __future__ import annotations

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
