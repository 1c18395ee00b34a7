"""The Paphos version, in one place: pyproject.toml reads it (`[tool.setuptools.dynamic]`), and
`paphos --version`, GET /version and /.well-known/serviceinfo report it."""

__version__ = "0.1.0"
