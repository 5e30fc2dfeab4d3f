from click.testing import CliRunner

from kvbench import __version__
from kvbench.cli.main import _register, cli


def test_version():
    _register()
    r = CliRunner().invoke(cli, ["--version"])
    assert r.exit_code == 0 and __version__ in r.output
