"""splitinfer: privacy-aware split inference of decoder-only LLMs over a wide-area network."""

__version__ = "0.1.0"
