"""The installed distribution's version, for the User-Agent header and `pe-client --version`."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pe-client")
except PackageNotFoundError:
    __version__ = "0.0.0+unknown"
