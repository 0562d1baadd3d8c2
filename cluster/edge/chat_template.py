"""The model's chat template: renders a conversation (and its tools) to the prompt text, and knows whether it can."""

from __future__ import annotations

import jinja2
import jinja2.meta


class ChatTemplate:
    """The tokenizer's template, read once: whether it renders `tools` is known before any request asks."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.takes_tools = _uses_tools(tokenizer)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text, ending where the assistant's reply starts (the template writes BOS itself)."""
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def _uses_tools(tokenizer) -> bool:
    """Whether the template (the "tool_use" one where a tokenizer has several) reads the `tools` variable: a
    template that does not would drop the tools silently, and the model would never hear of them."""
    try:
        source = tokenizer.get_chat_template(tools=[{"type": "function", "function": {"name": "probe"}}])
    except ValueError:  # no template at all
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))
