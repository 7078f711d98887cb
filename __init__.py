"""dsv4c: an ahead-of-time compiler for the DeepSeek-V4 model family."""

__version__ = "0.1.0"
