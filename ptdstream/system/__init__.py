"""The operating system layer: page-cache control and file reading primitives."""

__all__: list[str] = []
