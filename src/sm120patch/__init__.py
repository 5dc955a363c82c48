"""sm120patch: exact, reversible SM120 enablement patches for FlashInfer and SGLang."""

__version__ = "0.1.0"
