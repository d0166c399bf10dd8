#!/usr/bin/env python3
"""Writes tests/data/chat_templates/*.json: chat templates, contexts and the text Python's jinja2
renders for them, for src/text/jinja_test.cc (and src/infer/serve_chat_template_test.cc) to compare k3's renderer against.

The reference is jinja2 itself, set up the way Hugging Face transformers renders a tokenizer's
chat_template (transformers' _compile_jinja_template, written out here so transformers is not
needed):
    ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    filters["tojson"] = json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
                                   sort_keys=sort_keys)          (keys in insertion order)
    globals["raise_exception"] = raise TemplateError(message)
and the context transformers' apply_chat_template passes: messages, add_generation_prompt, tools,
documents (None unless given) and the tokenizer's special tokens (bos_token, eos_token, ...).

The templates are written here in the style of public model templates (ChatML as Qwen and Kimi
use it, Llama 3, Mistral/Llama 2 with role checks, a tool-calling template), not copied from them.

Each file: {"description", "template", "cases": [{"name", "context", "expected"} or
{"name", "context", "raises"}]}. errors.json lists templates jinja2 refuses to parse, with
jinja2's message and the words k3's message must contain.

Usage: python3 tools/make_chat_template_goldens.py [--out tests/data/chat_templates]
Needs: pip install jinja2 (3.x). Deterministic.
"""
import argparse
import json
import pathlib

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


# ---------------------------------------------------------------------------------------------
# Templates

CHATML = """\
{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Kimi's layout: a role marker per message, <|im_middle|> between the name and the text, a macro
# that flattens content given as a list of parts.
KIMI = """\
{%- macro render_content(msg) -%}
    {%- set c = msg.get('content') -%}
    {%- if c is string -%}
        {{- c -}}
    {%- elif c is not none -%}
        {%- for part in c -%}
            {%- if part['type'] == 'text' -%}{{ part['text'] }}{%- else -%}<|media_pad|>{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- for message in messages -%}
    {%- set name = message.get('name') or message['role'] -%}
    {%- if message['role'] == 'user' -%}
        <|im_user|>{{ name }}<|im_middle|>
    {%- elif message['role'] == 'assistant' -%}
        <|im_assistant|>{{ name }}<|im_middle|>
    {%- elif message['role'] == 'system' -%}
        <|im_system|>{{ name }}<|im_middle|>
    {%- else -%}
        {{ raise_exception("Unknown role '" ~ message['role'] ~ "'") }}
    {%- endif -%}
    {{- render_content(message) -}}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""

LLAMA3 = """\
{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Mistral / Llama 2 style: [INST] blocks, the optional system prompt folded into the first user
# turn, and raise_exception when roles do not alternate.
ALTERNATING = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, after an optional system message') }}
    {%- endif %}
{%- endfor %}
"""

# No "-" markers at all: the output's whitespace comes from trim_blocks and lstrip_blocks alone
# (and "+" turning them off), as in older templates. Ends with a newline, which Jinja drops.
WHITESPACE = """\
{# A template that relies on trim_blocks / lstrip_blocks. #}
{% for message in messages %}
    {% if message.role == 'system' %}
<<SYS>>
{{ message.content }}
<</SYS>>
    {% elif message.role == 'user' %}
  User: {{ message.content }}
    {% else %}
  Assistant: {{ message.content }}   {# trailing spaces before a comment stay #}
    {% endif %}
{% endfor %}
    {%+ if add_generation_prompt %}[kept indent]{% endif +%}
  Assistant:{{ ' ' }}
"""

# The expression language: loop variables, set and its scoping, namespace, if/elif chains,
# operators, filters, tests, string methods, slices, literals, tojson.
EXPRESSIONS = """\
{%- set ns = namespace(users=0, last_user=-1) -%}
{%- set greeting = 'x' -%}
{%- for m in messages -%}
    {%- set greeting = 'scoped to one pass' -%}
    {%- if m.role == 'user' -%}
        {%- set ns.users = ns.users + 1 -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
users={{ ns.users }} last_user={{ ns.last_user }} greeting={{ greeting }}
{% for m in messages -%}
[{{ loop.index }}/{{ loop.length }}{{ ' first' if loop.first }}{{ ' last' if loop.last }}] {{ m.role|upper }}
{%- if m.role == 'system' %} (system)
{%- elif m.role == 'user' and m.content|length > 20 %} (long user: {{ m.content|length }} chars)
{%- elif m.role == 'user' %} (user)
{%- else %} (other: {{ m.role }})
{%- endif %}: {{ m.content|trim }}
{% endfor -%}
roles={{ messages|map(attribute='role')|join(',') }} users_only={{ messages|selectattr('role', 'equalto', 'user')|list|length }}
first={{ messages[0].role }} last={{ messages[-1].role }} middle={{ messages[1:-1]|length }} reversed={{ (messages|map(attribute='role')|list)[::-1]|join('<') }}
{% set text = messages[-1].content -%}
strip=[{{ text.strip() }}] lstrip=[{{ text.lstrip() }}] rstrip=[{{ text.rstrip() }}] split={{ text.split() }} split_comma={{ 'a,b,,c'.split(',') }}
starts={{ text.strip().startswith('What') }} ends={{ text.strip().endswith('?') }} has_q={{ '?' in text }} no_z={{ 'z' not in text }}
lower={{ 'MiXeD'|lower }} upper={{ 'MiXeD'|upper }} title={{ 'hello big world'.title() }} replace={{ 'a-b-c'.replace('-', '+') }}
math={{ 7 + 3 * 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 0.1 + 0.2 }} {{ 1e-5 }} {{ 3.0 }}
concat={{ 'n=' ~ 42 ~ ' f=' ~ 1.5 ~ ' b=' ~ true ~ ' none=' ~ none }}
compare={{ 1 < 2 < 3 }} {{ 'abc' < 'abd' }} {{ 1 == 1.0 }} {{ [1, 2] == [1, 2] }} {{ none is none }} {{ 2 != 2 }}
logic={{ true and 'yes' }} {{ false or 'fallback' }} {{ '' or 'empty' }} {{ not messages }} {{ none or 0 or 'last' }}
tests={{ undefined_var is defined }} {{ undefined_var is not defined }} {{ messages is sequence }} {{ messages[0] is mapping }} {{ 'x' is string }} {{ 3 is odd }} {{ 4 is divisibleby 2 }} {{ none is not none }}
defaults={{ undefined_var|default('d') }} {{ ''|default('e', true) }} {{ messages[0].missing is defined }}
literals={{ [1, 'two', none, true, 2.5] }} {{ {'k': 'v', 'n': [1, {'deep': none}]} }} {{ ('t', 1)|join('+') }} {{ 'it''s' ~ "\\t|\\u00e9|\\x41" }}
json={{ messages[0]|tojson }} {{ {'b': 1, 'a': [true, none, 0.5, 'é"\\n']}|tojson }}
json_indent={{ {'a': [1, {'b': []}], 'c': {}}|tojson(indent=2) }}
items={% for k, v in {'one': 1, 'two': 2}.items() %}{{ k }}:{{ v }}{{ ',' if not loop.last }}{% endfor %} get={{ messages[0].get('role') }}/{{ messages[0].get('nope', 'dflt') }}
loops={% for i in range(10) %}{% if i is even %}{% continue %}{% endif %}{% if i > 7 %}{% break %}{% endif %}{{ i }}{% endfor %} else={% for x in [] %}x{% else %}empty{% endfor %}
"""

# A tool-calling template in the Qwen 2.5 / Hermes style: tools as JSON lines in the system
# prompt, assistant tool calls as <tool_call> JSON, tool results as <tool_response> in user turns.
TOOLS = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions. Signatures:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# ---------------------------------------------------------------------------------------------
# Conversations

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def conv(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


ONE_USER = conv(("user", "Hello!"))
SYSTEM_USER = conv(("system", "You are terse."), ("user", "What is 2+2?"))
MULTI_TURN = conv(("system", "  Answer in French.  "), ("user", "Hi"), ("assistant", "Bonjour !"),
                  ("user", "  How are you?\n"))
TRICKY_TEXT = conv(("user", "Quotes ' \" and \\ backslash, tab\there, unicode é✓😀, braces {{ x }} {% y %}"),
                   ("assistant", "Line one\nLine two\n"), ("user", "  What now?  "))
USER_USER = conv(("user", "first"), ("user", "second"))
TOOL_TURNS = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": city, "unit": "c"}}}
                    for city in ("Paris", "Tokyo")]},
    {"role": "tool", "content": "{\"temp\": 18}"},
    {"role": "tool", "content": "{\"temp\": 24}"},
    {"role": "assistant", "content": "Paris 18 °C, Tokyo 24 °C."},
    {"role": "user", "content": "Thanks"},
]
TOOLS_LIST = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"type": "string"},
                                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time, ISO 8601 — UTC",
                                      "parameters": {"type": "object", "properties": {}}}},
]


def context(messages, add_generation_prompt=True, tools=None, **extra):
    """What transformers' apply_chat_template passes to the template (and k3's ChatFormat::render)."""
    return {**SPECIAL, "messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools,
            "documents": None, **extra}


SUITES = {
    "chatml": ("ChatML as Qwen and Kimi use it: <|im_start|>role ... <|im_end|>, a default system prompt",
               CHATML, [("one_user", context(ONE_USER)), ("system_user", context(SYSTEM_USER)),
                        ("multi_turn", context(MULTI_TURN)), ("tricky_text", context(TRICKY_TEXT)),
                        ("no_generation_prompt", context(MULTI_TURN, add_generation_prompt=False))]),
    "kimi": ("Kimi-style role markers with <|im_middle|>, a macro for content parts, raise_exception for unknown roles",
             KIMI, [("one_user", context(ONE_USER)), ("multi_turn", context(MULTI_TURN)),
                    ("content_parts", context([{"role": "user", "name": "ann", "content": [
                        {"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": "x"}},
                        {"type": "text", "text": " what is it?"}]}])),
                    ("null_content", context(conv(("user", "q"), ("assistant", None)), add_generation_prompt=False)),
                    ("unknown_role", context(conv(("user", "q"), ("robot", "beep"))))]),
    "llama3": ("Llama 3 style headers, bos_token, |trim, set messages = messages[1:], date_string default",
               LLAMA3, [("one_user", context(ONE_USER)), ("system_user", context(SYSTEM_USER)),
                        ("multi_turn", context(MULTI_TURN)), ("tricky_text", context(TRICKY_TEXT)),
                        ("date_given", context(SYSTEM_USER, date_string="01 Jan 2030"))]),
    "alternating": ("Mistral / Llama 2 [INST] style with raise_exception on a non-alternating role order",
                    ALTERNATING, [("one_user", context(ONE_USER)), ("system_user", context(SYSTEM_USER)),
                                  ("multi_turn", context(MULTI_TURN)), ("user_user", context(USER_USER)),
                                  ("assistant_first", context(conv(("assistant", "hi"), ("user", "yo")))),
                                  ("bad_role", context(conv(("user", "a"), ("tool", "b"))))]),
    "whitespace": ("whitespace from trim_blocks / lstrip_blocks alone, +%} / {%+ and comments",
                   WHITESPACE, [("multi_turn", context(MULTI_TURN)),
                                ("no_generation_prompt", context(SYSTEM_USER, add_generation_prompt=False))]),
    "expressions": ("the expression language: loop.*, set scoping, namespace, elif chains, operators, filters, "
                    "tests, string methods, slices, literals, tojson",
                    EXPRESSIONS, [("multi_turn", context(MULTI_TURN)), ("tricky_text", context(TRICKY_TEXT))]),
    "tools": ("tool calling in the Qwen 2.5 / Hermes style: tools | tojson, tool_calls, grouped tool responses",
              TOOLS, [("with_tools", context(TOOL_TURNS, tools=TOOLS_LIST)),
                      ("without_tools", context(SYSTEM_USER))]),
}

# Templates jinja2 refuses to parse, and what k3's message must say.
SYNTAX_ERRORS = [
    ("unterminated_variable", "Hello {{ name ", "unterminated tag"),
    ("unterminated_block", "{% if x %}yes{% endif", "unterminated tag"),
    ("unterminated_comment", "a {# never closed", "unterminated comment"),
    ("unclosed_if", "{% for m in messages %}{% if m %}x{% endfor %}", "'{% endfor %}'"),
    ("never_closed", "{% for m in messages %}{{ m }}", "never closed"),
    ("unknown_filter", "{{ messages | shout }}", "unknown filter 'shout'"),
    ("unknown_tag", "{% frobnicate %}", "unknown tag 'frobnicate'"),
    ("bad_expression", "{{ 1 + }}", "expected an expression"),
    ("unterminated_string", "{{ 'abc }}", "unterminated string"),
    ("stray_else", "{% else %}", "unexpected '{% else %}'"),
    ("unbalanced_bracket", "{{ [1, 2 }}", "unexpected '}'"),
]


def render(env, source, ctx):
    try:
        return {"expected": env.from_string(source).render(**ctx)}
    except jinja2.exceptions.TemplateSyntaxError:
        raise
    except jinja2.exceptions.TemplateError as e:
        return {"raises": e.message}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent.parent / "tests/data/chat_templates"))
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    for name, (description, source, cases) in SUITES.items():
        rows = []
        for case_name, ctx in cases:
            rows.append({"name": case_name, "context": ctx, **render(env, source, ctx)})
        doc = {"description": description, "template": source, "cases": rows}
        (out / f"{name}.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"{name}.json: {len(rows)} cases ({sum('raises' in r for r in rows)} raise)")
    errors = []
    for name, source, k3_says in SYNTAX_ERRORS:
        try:
            env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            errors.append({"name": name, "template": source, "jinja2_error": e.message, "k3_message_contains": k3_says})
            continue
        raise SystemExit(f"jinja2 parsed the '{name}' template, which should be a syntax error")
    text = json.dumps({"cases": errors}, ensure_ascii=False, indent=1) + "\n"
    (out / "errors.json").write_text(text, encoding="utf-8")
    print(f"errors.json: {len(errors)} templates jinja2 rejects")


if __name__ == "__main__":
    main()
