"""Tool calls in a model's text, as Hermes/Qwen chat templates write them:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (arguments also as a JSON
string, OpenAI style). Shared by the tool-using envs (code-math, geometry3k-tool)."""

from __future__ import annotations

import json
import re

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def tool_calls(text: str, tool: str, arg: str, usage: str) -> tuple[list[str], list[str], str]:
    """The `<tool_call>`s in `text`: (the argument `arg` of each usable call to `tool`,
    why each other call cannot be used, the text outside the calls). `usage` as in
    tool_argument."""
    args: list[str] = []
    errors: list[str] = []
    for body in TOOL_CALL.findall(text):
        value, err = tool_argument(body, tool, arg, usage)
        if err:
            errors.append(err)
        else:
            args.append(value)
    return args, errors, TOOL_CALL.sub("", text)


def tool_argument(body: str, tool: str, arg: str, usage: str) -> tuple[str, str]:
    """(the string argument `arg` of a call to `tool`, "") from a tool call's JSON
    `body`, or ("", why it cannot be used). `usage` ends the message for a call without
    that argument, e.g. 'the python tool needs {"arguments": {"code": "<python source>"}}'."""
    try:
        call = json.loads(body)
        args = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if isinstance(args, str):  # OpenAI style: arguments as a JSON string
            args = json.loads(args)
    except json.JSONDecodeError as e:
        return "", f"the tool call is not valid JSON ({e})"
    if not isinstance(call, dict):
        return "", 'a tool call is a JSON object {"name": ..., "arguments": {...}}'
    if call.get("name") != tool:
        return "", f"unknown tool {call.get('name')!r}: the only tool is {tool!r}"
    if not isinstance(args, dict) or not isinstance(args.get(arg), str):
        return "", usage
    return args[arg], ""


def parse_call(body: str) -> tuple[str, dict, str]:
    """(name, arguments, "") of a tool call's JSON `body` (arguments as an object or, OpenAI
    style, a JSON string; none given is {}), or ("", {}, why it cannot be read)."""
    try:
        call = json.loads(body)
        args = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError as e:
        return "", {}, f"the tool call is not valid JSON ({e})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return "", {}, 'a tool call is a JSON object {"name": ..., "arguments": {...}}'
    if not isinstance(args, dict):
        return "", {}, f"the arguments of {call['name']!r} must be a JSON object"
    return call["name"], args, ""
