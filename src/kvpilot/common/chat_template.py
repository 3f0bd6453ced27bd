"""The chat template applied to checked messages: one rendering for the daemon's routes and the
router's prefix hashes, so that both see the same prompt tokens."""

from __future__ import annotations

from typing import Any

from .tools import template_inputs, template_supports_tools


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list | None, *,
                add_generation_prompt: bool, continue_final_message: bool) -> Any:
    """Tools, tool calls and tool results go in natively when the template knows them, else as Hermes
    text. Template errors are the caller's to map (the daemon answers 400, the router routes on load)."""
    native_tools = None
    if tools or any("tool_calls" in m or m.get("role") == "tool" for m in messages):
        messages, native_tools = template_inputs(messages, tools or [], template_supports_tools(tokenizer))
    return tokenizer.apply_chat_template(messages, tools=native_tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message)
