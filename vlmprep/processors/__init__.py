"""Processors: resolve --processor (hub id, local dir, builtin:NAME), the builtin cache and its Qwen / Llama /
Mistral builds."""
