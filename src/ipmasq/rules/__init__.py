"""Pure renderers and parsers of the kernel's rule dialects."""
