"""dhp: disaggregated hybrid parallelism for multimodal training."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dhp")
except PackageNotFoundError:  # a source tree on PYTHONPATH that was never pip-installed
    __version__ = "0+unknown (not installed: pip install -e .)"
