"""Token ids for a chat: prompts and observations rendered by the model's chat template
(or a vision-language model's processor's), as the agent loop and the OpenAI-compatible
endpoint feed them to the engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ChatRenderer:
    """Token ids for prompts and observations from a tokenizer's chat template, or a
    vision-language model's processor's (`processor`, None for a text model)."""

    _PLACEHOLDER = "\u2063ot-action\u2063"

    def __init__(self, tokenizer: Any, processor: Any = None):
        self.tok = tokenizer
        self.processor = processor
        self._closing: str | None = None
        template = getattr(processor or tokenizer, "chat_template", None) or ""
        #: the template renders `tools` (and `tool` messages): tool calls in its own format
        self.supports_tools = isinstance(template, str) and "tools" in template
        #: the text of one image's placeholder before expansion (e.g. "<image>")
        self.image_token: str = getattr(processor, "image_token", "") or "" if processor is not None else ""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None) -> str:
        kw = {"tools": tools} if tools and self.supports_tools else {}
        return (self.processor or self.tok).apply_chat_template(messages, tokenize=False,
                                                                add_generation_prompt=add_generation_prompt, **kw)

    def message(self, role: str, text: str, images: int = 0) -> dict[str, Any]:
        """A chat message: `text` as content, or with `images` the processor's parts
        ([image] * images, then the text). Text from an env never carries placeholders
        of its own: an image's place comes only from the images it sent. Raises
        ValueError for images when the model is a text model."""
        if images and not self.image_token:
            raise ValueError(f"{images} images for a text model: serve a vision-language model")
        if self.image_token:
            text = text.replace(self.image_token, "")
        if not images:
            return {"role": role, "content": text}
        return {"role": role, "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}

    def ids(self, text: str, images: Sequence[bytes] = ()) -> list[int]:
        """Token ids of rendered `text` (the template already holds any BOS/special
        tokens as text); with `images`, each placeholder expanded by the processor into
        the model's image tokens. Raises ValueError when the images do not match the
        placeholders (or a text model is given images)."""
        if not images:
            return list(self.tok(text, add_special_tokens=False)["input_ids"])
        if self.processor is None or not self.image_token:
            raise ValueError(f"{len(images)} images for a text model: serve a vision-language model")
        if (n := text.count(self.image_token)) != len(images):
            raise ValueError(f"the chat template placed {n} image placeholders for {len(images)} images")
        from opentinker.environment.images import decode_image

        enc = self.processor(text=[text], images=[decode_image(b) for b in images], add_special_tokens=False)
        return list(enc["input_ids"][0])

    def opening(self, system: str, user: str, images: int = 0) -> list[dict[str, Any]]:
        """An episode's first messages: [system (when not empty),] user (with `images`
        image parts). Raises ValueError as message() does."""
        return ([self.message("system", system)] if system else []) + [self.message("user", user, images)]

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                   images: Sequence[bytes] = ()) -> list[int]:
        """The first prompt: `messages` (and `tools`, where the template defines them)
        rendered with the generation prompt; `images` those of its image parts, in order."""
        return self.ids(self.render(messages, add_generation_prompt=True, tools=tools), images)

    def observation_role(self, tools: list[dict[str, Any]] | None) -> str:
        """"tool" when the env declared tools and the template renders them, else "user"."""
        return "tool" if tools and self.supports_tools else "user"

    def closing(self) -> str:
        """The text the template puts after an assistant message's content (e.g.
        "<|im_end|>\\n" for ChatML)."""
        if self._closing is None:
            text = self.render([{"role": "user", "content": "x"},
                                {"role": "assistant", "content": self._PLACEHOLDER}], False)
            at = text.rfind(self._PLACEHOLDER)
            self._closing = text[at + len(self._PLACEHOLDER):] if at >= 0 else ""
        return self._closing

    def observation_ids(self, history: list[dict[str, Any]], observation: str,
                        last_token: int | None, finish_reason: str, role: str = "user",
                        tools: list[dict[str, Any]] | None = None, images: Sequence[bytes] = ()) -> list[int]:
        """Ids that close the last assistant turn and open the next one with
        `observation` as a `role` message ("user", or "tool" for a tool result; with
        `images` ahead of its text), ending in the generation prompt.

        history: the conversation so far, ending with the assistant's action text.
        The delta is the rendering with the new user message (and the generation
        prompt) minus the rendering without it. The policy's own tokens are kept as
        sampled, so what the template would put after the action comes first: all of
        the assistant closing when the turn was cut at max_new_tokens, only its rest
        when the sampled stop token is its start (ChatML: "\\n" after <|im_end|>).
        """
        obs = self.message(role, observation, len(images))
        without = self.render(history, False, tools)
        with_obs = self.render(history + [obs], True, tools)
        if with_obs.startswith(without):
            delta = with_obs[len(without):]
        else:
            # a template that rewrites earlier turns (e.g. strips reasoning from past
            # assistant messages) is not prefix-stable; a neutral history still gives
            # the text between turns
            h = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
            a, b = self.render(h, False, tools), self.render(h + [obs], True, tools)
            delta = b[len(a):] if b.startswith(a) else b
        closing = self.closing()
        if finish_reason == "stop" and last_token is not None:
            stop_text = self.tok.decode([last_token], skip_special_tokens=False)
            if stop_text and closing.startswith(stop_text):
                closing = closing[len(stop_text):]
        return self.ids(closing + delta, images)
