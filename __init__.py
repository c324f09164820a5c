"""DeepInfer: a compiler-driven inference engine. `from deepinfer import LLM, SamplingParams`."""

_LAZY = ("LLM", "SamplingParams", "RequestOutput")


def __getattr__(name):
    # Imported on first use so that `import deepinfer.ir` (and the CLI) do not load the runtime.
    if name in _LAZY:
        from . import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")


__all__ = list(_LAZY)
